"""pytest plugin (`-p tests.gpu_plugin`, scripts/gpu_check.sh): run the Pallas
kernels compiled for the GPU (interpret=False) in tests written for
interpret mode, by wrapping every public function of pallas_kernels' modules
that takes `interpret`."""

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
    return call


for info in pkgutil.iter_modules(pallas_kernels.__path__):
    module = importlib.import_module(f"pallas_kernels.{info.name}")
    for name, fn in list(vars(module).items()):
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        try:
            if "interpret" in inspect.signature(fn).parameters:
                setattr(module, name, _compiled(fn))
        except (TypeError, ValueError):
            pass
