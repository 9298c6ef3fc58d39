"""What each process of a multi-process job runs besides the training: the process group (gloo, or
oneCCL's ``ccl`` built here), its status reports to the launcher, and the test-only faults.

Below :mod:`helpers.training` (the engine starts the group and reports its steps) and above
:mod:`helpers.core`; the launcher's side lives in :mod:`helpers.launching`."""
