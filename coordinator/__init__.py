"""The coordinator process: the forward pass (model/), the executor and its processes
(runtime/), text in and out (text/), and the commands (cli/, serve/, tools/)."""
import os
import sys

# torch's OpenMP threads spin after each parallel region by default, stealing the cores the
# worker processes need between two layers (measured: 0.4 tok/s instead of 9 on 2 cores). So
# our process wants OMP_WAIT_POLICY=PASSIVE -- but only for itself. libgomp reads the variable
# once, when it is loaded, which is when torch is first imported. Exporting it for the rest of
# the process's life also handed it to every program started from here or loaded into this
# process (llama.cpp run by the benchmark got 27.6 tok/s instead of 90.5), so the variable is
# set only while torch's own module executes and the previous environment is restored right
# after. Imports stay lazy: a process that never imports torch never pays for it. Workers get
# their policy from worker_pool._worker_env (their own environment, set for them alone).
# If torch was imported before this package, it is too late to choose, and nothing is changed.
# The same hook gives torch the intra-op thread count the engine chose (set_torch_threads):
# a plain llama model in the file's blocks never imports torch, others import it on first use.
_WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")
_torch_threads: int | None = None


def set_torch_threads(n: int) -> None:
    """torch's intra-op thread count in this process: now if torch is loaded, else as soon as
    it is (coordinator/model/torch_layers.py and the tools import it where a path needs it)."""
    global _torch_threads
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(n)
    else:
        _torch_threads = n


class _PassiveOpenMPOnTorchImport:
    """A one-shot meta path finder: wraps the loader of the first `import torch` so that
    OMP_WAIT_POLICY is PASSIVE (unless the user set it) exactly while torch/__init__ runs."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        self.uninstall()
        from importlib.util import find_spec

        spec = find_spec("torch")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_with_policy(module):
            var, value = _WAIT_POLICY
            had = var in os.environ
            old = os.environ.setdefault(var, value)
            try:
                exec_module(module)
                if _torch_threads is not None:
                    module.set_num_threads(_torch_threads)
            finally:
                if not had:
                    os.environ.pop(var, None)
                elif os.environ.get(var) != old:
                    os.environ[var] = old
                try:
                    del loader.exec_module  # back to the class's own method
                except AttributeError:
                    pass

        loader.exec_module = exec_with_policy
        return spec

    def uninstall(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


if "torch" not in sys.modules and not any(
        isinstance(f, _PassiveOpenMPOnTorchImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PassiveOpenMPOnTorchImport())
