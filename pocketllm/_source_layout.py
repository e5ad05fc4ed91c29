"""Let a source checkout import as the installed wheel does.

The wheel installs ``proto/`` and ``workers/`` inside the package as
``pocketllm.proto`` and ``pocketllm.workers`` (setuptools ``package-dir``). In a
checkout they sit beside ``pocketllm/``, so a Python started in the clone root
(which puts the current directory first on ``sys.path``) would find this package
without them. This finder maps exactly those two names to the checkout's folders;
in an installed wheel it is never registered.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PACKAGE)
MAPPED = ("proto", "workers")


def _is_checkout() -> bool:
    return (os.path.isfile(os.path.join(_ROOT, "pyproject.toml"))
            and all(not os.path.isdir(os.path.join(_PACKAGE, name))
                    and os.path.isfile(os.path.join(_ROOT, name, "__init__.py"))
                    for name in MAPPED))


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != "pocketllm" or name not in MAPPED:
            return None
        folder = os.path.join(_ROOT, name)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


def install() -> None:
    if _is_checkout() and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder())


def package_root() -> str:
    """The folder that holds this ``pocketllm`` package (a checkout or site-packages)."""
    return _ROOT
