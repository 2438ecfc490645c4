"""Every attribute this package sets on an object it does not own (a Transformers model's ``save_pretrained``, a
modeling module's function, Lightning's precision plugin), installed, recorded and undone in one place.

A patch sets one attribute of one object (an instance, a module or a class) and remembers what the object itself
held under that name before (its own ``__dict__`` entry, or its absence: an instance attribute that shadows a class's
method, say), so that undoing it restores exactly that. An attribute is patched once: a second patch of it is refused
rather than stacked silently (:func:`installed` says whether it is patched, :meth:`Patch.add_owner` shares a patch).

Each patch has owners: the objects whose lifetime it belongs to (a model, a strategy's plugin). A strategy's teardown
undoes what its model owns (:func:`undo_owned`); a patch shared by several owners is undone with the last one. Patches
of modules and classes change the whole process (:func:`is_process_wide`); those of an instance live with it, and may
be kept when only the process-wide ones are undone (a model's ``save_pretrained`` is still called after ``fit``).

Nothing here is global and nothing keeps an object alive: a patch's record lives on the patched object (an entry's
on the module or class holding the registry), the list of an owner's patches on the owner (weakly), and a patch holds
its owners weakly.

The lowest layer: imports nothing of the package.
"""

from __future__ import annotations

import copy
import enum
import inspect
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The attribute of a patched object that holds its patches' records, by attribute name.
RECORDS_ATTR = "_lightning_tp_patches"


class _Absent(enum.Enum):
    """What a patched object held under the name before: nothing of its own (an enum member survives ``deepcopy``)."""

    ABSENT = "absent"


#: The previous value of an attribute the object did not hold itself (undo deletes the attribute).
ABSENT = _Absent.ABSENT

#: The attribute of an owner that holds its patches (weakly, in the order installed).
OWNED_ATTR = "_lightning_tp_owned_patches"


class _Owned(list):
    """An owner's patches, held weakly. A copy of the owner (``copy.deepcopy`` of a model) owns none of them: it gets
    an empty list (a patched object itself cannot be pickled: its records hold weak references)."""

    def __reduce__(self) -> tuple:
        return (_Owned, ())

    def forget(self, ref: weakref.ref) -> None:
        """Drop ``ref``, a patch's reference that died (its weak reference's callback)."""
        self[:] = [held for held in self if held is not ref]


class Patch:
    """One attribute set by :func:`install`: ``target.name = value``, ``previous`` the object's own value before (or
    :data:`ABSENT`)."""

    def __init__(self, target: Any, name: str, value: Any, previous: Any) -> None:
        # Held weakly: the record lives on the target, and a strong reference back would make every patched object
        # (a model) a reference cycle, freed only by the cyclic collector instead of when its last user drops it.
        self._target = _held(target)
        self.name = name
        self.value = value
        self.previous = previous
        self.active = True
        self._owners: list[weakref.ref] = []

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        where = self.target.__name__ if is_process_wide(self.target) else type(self.target).__name__
        return f"<Patch {where}.{self.name} ({state})>"

    @property
    def target(self) -> Any:
        """The patched object (``None`` once it is gone)."""
        return self._target()

    def __deepcopy__(self, memo: dict) -> Patch:
        """The record of a deep copy of the target names the copy (``copy.deepcopy`` of a patched model)."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        target = self.target
        if target is not None and not is_process_wide(target):
            twin._target = _held(copy.deepcopy(target, memo))
        twin.value = copy.deepcopy(self.value, memo)
        twin.previous = copy.deepcopy(self.previous, memo)
        twin._owners = list(self._owners)
        return twin

    @property
    def owners(self) -> list[Any]:
        """The owners still alive."""
        return [owner for ref in self._owners if (owner := ref()) is not None]

    def add_owner(self, owner: object) -> None:
        """Share this patch with ``owner`` too: :func:`undo_owned` undoes it once no owner holds it.

        Args:
            owner: an object that can be weakly referenced (a module, a model, a strategy).

        Raises:
            ValueError: if the patch was undone, or ``owner`` cannot be weakly referenced.
        """
        if not self.active:
            raise ValueError(f"{self!r} was undone; install it again instead of sharing it.")
        if any(owner is held for held in self.owners):
            return
        owned = _owned_list(owner)
        self._owners.append(weakref.ref(owner))
        owned.append(weakref.ref(self, owned.forget))  # gone from the list when the patch is (no growth)

    def release(self, owner: object) -> bool:
        """Give up ``owner``'s hold on this patch, and undo it if no other owner holds it.

        Args:
            owner: one of :attr:`owners`; another object changes nothing.

        Returns:
            Whether the patch was undone.
        """
        if not any(owner is held for held in self.owners):
            return False
        self._owners = [ref for ref in self._owners if ref() is not None and ref() is not owner]
        owned = _own_dict(owner).get(OWNED_ATTR)
        if owned is not None:
            owned[:] = [ref for ref in tuple(owned) if ref() is not None and ref() is not self]
        return not self._owners and self.undo()

    def undo(self) -> bool:
        """Restore what the object held before (delete the attribute if it held none of its own), whatever its owners.
        An attribute replaced since by someone else is left as they set it. Returns whether it was restored; undoing
        an undone patch does nothing."""
        if not self.active:
            return False
        self.active = False
        target = self.target
        if target is None:  # gone, and its record with it
            return False
        records = vars(target).get(RECORDS_ATTR)
        assert records is not None and records.get(self.name) is self, f"{self!r} is not the object's record"
        del records[self.name]
        if vars(target).get(self.name, ABSENT) is not self.value:
            return False
        if self.previous is ABSENT:
            delattr(target, self.name)
        else:
            setattr(target, self.name, self.previous)
        return True


def is_process_wide(target: object) -> bool:
    """Whether a patch of ``target`` changes the whole process: ``target`` is a module or a class (every user of it
    sees the patch), not one instance."""
    return isinstance(target, (types.ModuleType, type))


def installed(target: object, name: str) -> Patch | None:
    """The active patch of ``target.name`` (the object's own patch: a patched class does not make its instances
    patched), or ``None``."""
    try:
        records = vars(target).get(RECORDS_ATTR)
    except TypeError:  # no __dict__: nothing can have been patched
        return None
    return records.get(name) if records is not None else None


def install(target: object, name: str, value: Any, *, owner: object) -> Patch:
    """Set ``target.name = value``, recording what ``target`` held itself (its own attribute, or none: an instance's
    method comes from its class) so that :meth:`Patch.undo` restores exactly that.

    Args:
        target: the object patched: an instance, a module or a class, with a ``__dict__``.
        name: the attribute, a plain one (not a property, nor a submodule, parameter or buffer of an ``nn.Module``).
        value: what the attribute becomes.
        owner: what the patch belongs to (:func:`undo_owned` undoes the patches of an owner); held weakly.

    Raises:
        ValueError: if ``target.name`` is patched already (undo that patch first, or share it with
            :meth:`Patch.add_owner`), ``target`` has no ``__dict__``, ``name`` is not a plain attribute, or ``owner``
            cannot be weakly referenced.
    """
    _owned_list(owner)  # refuses an owner that cannot hold the list before anything is set
    patch = _install(target, name, value)
    patch.add_owner(owner)
    return patch


@contextmanager
def patched(target: object, name: str, value: Any) -> Iterator[Patch]:
    """:func:`install` for the ``with`` block only: undone on leaving it (an exception included); no owner.

    Args:
        target: as for :func:`install`.
        name: as for :func:`install`.
        value: as for :func:`install`.

    Raises:
        ValueError: as :func:`install`.
    """
    patch = _install(target, name, value)
    try:
        yield patch
    finally:
        patch.undo()


def install_for_call(target: object, name: str, value: Any) -> Patch:
    """:func:`install` with no owner, for a span its caller ends with :meth:`Patch.undo` (a forward's pre-hook
    installs, its post-hook undoes): :func:`patched` where the span is not one ``with`` block.

    Args:
        target: as for :func:`install`.
        name: as for :func:`install`.
        value: as for :func:`install`.

    Raises:
        ValueError: as :func:`install`.
    """
    return _install(target, name, value)


def owned_by(owner: object) -> list[Patch]:
    """The active patches ``owner`` holds, in the order they were installed."""
    owned = tuple(_own_dict(owner).get(OWNED_ATTR) or ())  # a callback may rewrite the list meanwhile
    return [patch for ref in owned if (patch := ref()) is not None and patch.active]


def undo_owned(owner: object, *, instances: bool = True) -> list[Patch]:
    """Give up ``owner``'s patches, the latest first: each is undone unless another owner still holds it.

    Args:
        owner: the owner given to :func:`install` or :meth:`Patch.add_owner`.
        instances: also the patches of instances; ``False``: only the process-wide ones (of modules and classes,
            :func:`is_process_wide`), the instances' staying with them and with ``owner``.

    Returns:
        The patches undone.
    """
    undone = []
    for patch in reversed(owned_by(owner)):
        if not instances and not is_process_wide(patch.target):
            continue
        if patch.release(owner):
            undone.append(patch)
    return undone


class EntryPatch(Patch):
    """One entry set by :func:`install_entry`: ``mapping[name] = value`` in a registry that the module or class
    ``target`` holds (a process-wide registry of named implementations)."""

    def __init__(self, target: Any, mapping: dict, name: str, value: Any, previous: Any) -> None:
        super().__init__(target, name, value, previous)
        self.mapping = mapping

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<EntryPatch {self.target.__name__}[{self.name!r}] ({state})>"

    def undo(self) -> bool:
        """Remove the entry, or restore what it held before, if it still holds this patch's value."""
        if not self.active:
            return False
        self.active = False
        records = vars(self.target).get(RECORDS_ATTR)
        key = _entry_key(self.mapping, self.name)
        assert records is not None and records.get(key) is self, f"{self!r} is not the registry's record"
        del records[key]
        if self.mapping.get(self.name, ABSENT) is not self.value:
            return False
        if self.previous is ABSENT:
            del self.mapping[self.name]
        else:
            self.mapping[self.name] = self.previous
        return True


def _entry_key(mapping: dict, name: str) -> tuple[str, int, str]:
    """The key of an entry patch among the records of the module or class holding its registry (never an attribute
    name: those are strings). The registry lives as long as its holder, so its id names it."""
    return ("entry", id(mapping), name)


def installed_entry(target: type | types.ModuleType, mapping: dict, name: str) -> EntryPatch | None:
    """The active entry patch of ``mapping[name]`` in the registry that the module or class ``target`` holds, or
    ``None``."""
    records = vars(target).get(RECORDS_ATTR)
    return records.get(_entry_key(mapping, name)) if records is not None else None


def install_entry(target: type | types.ModuleType, mapping: dict, name: str, value: Any, *, owner: object) -> Patch:
    """Set ``mapping[name] = value`` in a registry held by the module or class ``target`` (process-wide), recording
    what it held, so that :meth:`Patch.undo` removes the entry (or restores it) once no owner holds it.

    Args:
        target: the module or class whose registry ``mapping`` is (named in errors and reprs).
        mapping: the registry.
        name: the key set.
        value: what it maps to.
        owner: what the entry belongs to (:func:`undo_owned`); held weakly.

    Raises:
        ValueError: if the entry is patched already (share it with :meth:`Patch.add_owner`), ``target`` is not a
            module or class, or ``owner`` cannot be weakly referenced.
    """
    if not is_process_wide(target):
        raise ValueError(f"A registry's holder must be a module or class, got a {type(target).__name__}.")
    _owned_list(owner)
    existing = installed_entry(target, mapping, name)
    if existing is not None:
        raise ValueError(f"`{name}` of {target.__name__}'s registry is patched already ({existing!r}).")
    patch = EntryPatch(target, mapping, name, value, mapping.get(name, ABSENT))
    mapping[name] = value
    if RECORDS_ATTR not in vars(target):
        setattr(target, RECORDS_ATTR, {})
    vars(target)[RECORDS_ATTR][_entry_key(mapping, name)] = patch
    patch.add_owner(owner)
    return patch


def _install(target: object, name: str, value: Any) -> Patch:
    try:
        own = vars(target)
    except TypeError:
        raise ValueError(f"{type(target).__name__} objects have no `__dict__`: they cannot be patched.") from None
    if name in (RECORDS_ATTR, OWNED_ATTR):
        raise ValueError(f"`{name}` holds the records of the patches; it cannot be patched itself.")
    existing = installed(target, name)
    if existing is not None:
        raise ValueError(
            f"`{name}` of this {type(target).__name__} is patched already ({existing!r}): undo that patch first, or "
            "share it (`Patch.add_owner`)."
        )
    if not isinstance(target, type):
        on_class = inspect.getattr_static(type(target), name, None)
        if hasattr(type(on_class), "__set__") or hasattr(type(on_class), "__delete__"):
            raise ValueError(f"`{type(target).__name__}.{name}` is a property or descriptor, not a plain attribute.")
    if name not in own and _served_by_getattr(target, name):
        raise ValueError(
            f"`{name}` of this {type(target).__name__} is not a plain attribute (it is served by `__getattr__`: a "
            "submodule, parameter or buffer of an `nn.Module`, say), so it cannot be patched and restored."
        )
    previous = own.get(name, ABSENT)
    setattr(target, name, value)
    if vars(target).get(name, ABSENT) is not value:  # `nn.Module.__setattr__` registers a module or parameter
        delattr(target, name)
        raise ValueError(
            f"Setting `{name}` of this {type(target).__name__} to a {type(value).__name__} does not set a plain "
            "attribute (an `nn.Module` registers modules and parameters elsewhere), so it cannot be patched."
        )
    if RECORDS_ATTR not in vars(target):
        setattr(target, RECORDS_ATTR, {})
    patch = Patch(target, name, value, previous)
    vars(target)[RECORDS_ATTR][name] = patch
    return patch


def _served_by_getattr(target: object, name: str) -> bool:
    """Whether ``target.name``, which ``target`` does not hold itself, resolves all the same although (for an instance)
    its class has no such attribute either: ``__getattr__`` computes it. A class's attribute it does not hold comes
    from a base, and an instance's from its class: the object's own attribute shadows those, and deleting it restores
    them."""
    if isinstance(target, type) or inspect.getattr_static(type(target), name, ABSENT) is not ABSENT:
        return False
    return hasattr(target, name) and name not in vars(target)  # a lazy module's `__getattr__` may import it now


def _held(target: object) -> Callable[[], Any]:
    """A weak reference to ``target``, or a function returning it if it cannot be weakly referenced."""
    try:
        return weakref.ref(target)
    except TypeError:
        return lambda: target


def _own_dict(owner: object) -> dict:
    """``owner``'s own attributes (empty for an object without any)."""
    try:
        return vars(owner)
    except TypeError:
        return {}


def _owned_list(owner: object) -> list[weakref.ref[Patch]]:
    """The list of ``owner``'s patches, kept on ``owner`` itself (created at its first patch)."""
    try:
        own = vars(owner)
        weakref.ref(owner)
    except TypeError:
        raise ValueError(
            f"A patch's owner must have attributes and be weakly referenceable (a module, a model, a strategy); got "
            f"a {type(owner).__name__}."
        ) from None
    owned = own.get(OWNED_ATTR)
    if owned is None:
        owned = _Owned()
        object.__setattr__(owner, OWNED_ATTR, owned)  # a plain attribute, also of an `nn.Module`
    return owned


__all__ = [
    "ABSENT",
    "OWNED_ATTR",
    "RECORDS_ATTR",
    "EntryPatch",
    "Patch",
    "install",
    "install_entry",
    "install_for_call",
    "installed",
    "installed_entry",
    "is_process_wide",
    "owned_by",
    "patched",
    "undo_owned",
]
