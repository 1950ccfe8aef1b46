"""Imported by the preloaded forkserver (harness.launch.forkserver): every heavy module a rank or a
crash driver needs, each only if it imports (Transformer Engine is absent on CPU machines; the
forkserver's own preload would stop at the first module that raises anything but ImportError).
Quietly: the forkserver writes to its starter's terminal, and a rank logs its own warnings."""
import importlib
import warnings

from harness.launch.forkserver import MODULES

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except Exception:  # noqa: BLE001 - a module this machine cannot import fails again, loudly, in the child
            pass
