"""Find the tools a process runs: import the tools modules an operator names.

A tools module exposes ``registry`` (an :class:`~outbox.contracts.Registry`) or, when
it has none, ``build_registry()`` returning one. ``outbox contracts --tools MODULE``
and the consumer load their tools this way, so both see the same contracts.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, overload

from outbox.contracts import Registry, ToolContract
from outbox.errors import ConfigurationError, ContractRefused, OutboxError

if TYPE_CHECKING:
    from outbox.settings import Settings

TOOLS_ENV = "OUTBOX_TOOLS"

_MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def module_list(values: Iterable[str]) -> list[str]:
    """Module paths from flags and variables that may each hold a comma-separated list."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


@overload
def registry_from(settings: Settings, *, required: Literal[True]) -> Registry: ...
@overload
def registry_from(settings: Settings, *, required: bool) -> Registry | None: ...
def registry_from(settings: Settings, *, required: bool) -> Registry | None:
    """The tools a command runs, from ``--tools`` / ``OUTBOX_TOOLS``: a daemon, the MCP
    server and the callbacks receiver need them (``required``: none is an error saying
    how to name them); an operator command or the console reads contracts only when it
    has them (None without)."""
    modules = module_list([settings.tools])
    if not modules and not required:
        return None
    return load_registry(modules)


def load_registry(module_paths: Sequence[str]) -> Registry:
    """One registry with every contract of every named tools module.

    The same contract object reached through two modules (one re-exports the other's
    registry) counts once; two different contracts with one name and version are
    refused, naming both modules, because a worker could not tell which one to run.
    """
    if not module_paths:
        raise ConfigurationError(
            "no tools modules given: pass --tools MODULE[,MODULE...] or set "
            f"{TOOLS_ENV}=module[,module...]"
        )
    merged = Registry()
    origins: dict[tuple[str, int], tuple[str, ToolContract[Any]]] = {}
    for position, module_path in enumerate(module_paths, start=1):
        registry = _registry_of(_import(module_path, position), module_path)
        for contract in registry:
            seen = origins.get(contract.key)
            if seen is not None:
                first_module, first_contract = seen
                if first_contract is contract:
                    continue
                raise ContractRefused(
                    f"tool {contract.label} is registered by both tools module "
                    f"{first_module!r} and {module_path!r}; give one of them a new "
                    "name or version"
                )
            merged.register(contract)
            origins[contract.key] = (module_path, contract)
    return merged


def _import(module_path: str, position: int) -> ModuleType:
    if not _MODULE_PATH.fullmatch(module_path):
        # Not echoed: a value this malformed may be anything pasted into the variable.
        raise ConfigurationError(
            f"tools module #{position} is not a dotted module path (e.g. outbox.sandbox.tools)"
        )
    try:
        return importlib.import_module(module_path)
    except OutboxError:
        # A contract refused at import time: its message already names tool and fix.
        raise
    except Exception as error:
        # Only the class name: import errors can quote source lines, and so secrets.
        detail = type(error).__name__
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if missing and not _is_same_or_parent(missing, module_path):
            detail += f" (it imports {missing!r}, which is not installed)"
        raise ConfigurationError(
            f"cannot import tools module {module_path!r}: {detail}; run "
            f"`python -c 'import {module_path}'` to see why, and check that its package "
            "is installed or on PYTHONPATH"
        ) from None


def _is_same_or_parent(name: str, module_path: str) -> bool:
    return module_path == name or module_path.startswith(name + ".")


def _registry_of(module: ModuleType, module_path: str) -> Registry:
    if hasattr(module, "registry"):
        registry = module.registry
        source = f"{module_path}.registry"
    elif callable(getattr(module, "build_registry", None)):
        source = f"{module_path}.build_registry()"
        try:
            registry = module.build_registry()
        except OutboxError:
            raise
        except Exception as error:
            raise ConfigurationError(f"{source} failed: {type(error).__name__}") from None
    else:
        raise ConfigurationError(
            f"tools module {module_path!r} must expose `registry` (an outbox.Registry) "
            "or `build_registry()` returning one"
        )
    if not isinstance(registry, Registry):
        raise ConfigurationError(f"{source} is a {type(registry).__name__}, not an outbox.Registry")
    return registry
