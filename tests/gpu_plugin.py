"""pytest plugin (`-p tests.gpu_plugin`, scripts/gpu_check.sh): run the Pallas
kernels compiled for the GPU (interpret=False) in tests written for
interpret mode, by wrapping every public callable of pallas_kernels' modules
that takes `interpret`: plain functions and jitted ones alike (a jitted
kernel is no Python function to `inspect`, but its signature is its
wrapped function's)."""

import functools
import importlib
import inspect
import pkgutil

import pallas_kernels


def _compiled(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs["interpret"] = False
        return fn(*args, **kwargs)
    call.forces_compiled = True
    return call


def _takes_interpret(fn) -> bool:
    try:
        return "interpret" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


for info in pkgutil.iter_modules(pallas_kernels.__path__):
    module = importlib.import_module(f"pallas_kernels.{info.name}")
    for name, fn in list(vars(module).items()):
        if name.startswith("_") or inspect.isclass(fn) or not callable(fn):
            continue
        if getattr(fn, "__module__", None) == module.__name__ and _takes_interpret(fn):
            setattr(module, name, _compiled(fn))
