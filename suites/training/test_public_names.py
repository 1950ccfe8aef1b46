"""`harness.training` names its handles too, without importing them (and transformers) until asked."""
from __future__ import annotations

import subprocess
import sys


def test_the_handles_are_exported_from_harness_training():
    import harness.training
    from harness.training import PolicyHandle, ReferenceHandle
    from harness.training import handles

    assert PolicyHandle is handles.PolicyHandle and ReferenceHandle is handles.ReferenceHandle
    assert {"PolicyHandle", "ReferenceHandle"} <= set(harness.training.__all__)


def test_importing_harness_training_does_not_import_the_handles():
    probe = "import sys, harness.training; print('harness.training.handles' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
