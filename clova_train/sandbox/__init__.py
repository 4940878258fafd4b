"""Sandboxed execution of LLM-generated Python against the visual tool API (HYDRA's reasoner, ViperGPT's API).

Layers, each of which stops the escapes the test corpus tries on its own where it can:

1. **Restriction** (:mod:`.policy`, in the worker): an allowlist of statement and expression kinds, then
   RestrictedPython (no ``_`` names or attributes, guarded attribute/item access and writes), allowlisted
   builtins.
2. **Isolation** (:mod:`.isolation`, the worker process): a fresh interpreter with an empty environment,
   unprivileged when started as root, rlimits (address space, CPU, file size 0, processes, descriptors), no
   spare descriptors, process and file functions stubbed, and a seccomp allowlist of system calls on Linux.
3. **Wire** (:mod:`.wire`): length-prefixed JSON with size limits both ways, never pickle; variables and the
   answer are checked in the worker under an output budget before anything is sent.
4. **Fresh tool API per run** (:mod:`.worker`): nothing a program does to ``ImagePatch`` outlives the run; the
   real tools stay in the training process (:mod:`.supervisor`), which checks every call before serving it.

Programs end a task by assigning ``final_answer``; variables persist across steps explicitly (returned by
:meth:`Sandbox.run`, passed back in by the caller), so nothing lives in the worker between runs.
"""

from clova_train.sandbox.policy import PolicyViolation, restricted_compile
from clova_train.sandbox.supervisor import ExecutionResult, Sandbox, SandboxError, Status, ToolAPI
from clova_train.sandbox.wire import PatchRef

__all__ = ["ExecutionResult", "PatchRef", "PolicyViolation", "Sandbox", "SandboxError", "Status", "ToolAPI",
           "restricted_compile"]
