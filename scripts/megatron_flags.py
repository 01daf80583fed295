#!/usr/bin/env python3
# Prints every "--flag" of Megatron-LM's pretraining argument parser (megatron/training/arguments.py, with the
# flags its ArgumentGroupFactory makes from the config dataclasses), one a line: the source of
# megatron/training/megatron_flags.inc. Needs torch; optional modules Megatron imports but that are not installed
# (TransformerEngine, apex, triton, ...) are stood in for by empty modules, since only the parser is built.
#   python3 scripts/megatron_flags.py <Megatron-LM checkout> > flags.txt
import sys, importlib.abc, importlib.machinery, types, argparse
from unittest import mock
MOCKED = {'triton', 'transformer_engine', 'apex', 'flash_attn', 'nvidia_resiliency_ext', 'tensorstore', 'zarr',
          'modelopt', 'nvtx', 'wandb', 'one_logger_utils', 'multistorageclient', 'flashinfer', 'deep_ep', 'grouped_gemm',
          'mamba_ssm', 'causal_conv1d', 'einops', 'emerging_optimizers', 'nv_one_logger', 'tqdm', 'packaging','onnx','sentencepiece','tiktoken','nltk','datasets','torch_memory_saver','hybrid_ep','cuda','cupy','numba','fla','nvshmem','pynvml','psutil','yaml','regex','blobfile','mistral_common','tokenizers'}
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        root = name.split('.')[0]
        if root in MOCKED:
            try:
                if root not in sys.modules:
                    sys.meta_path.remove(self)
                    try:
                        importlib.import_module(root); return None
                    except Exception: pass
                    finally: sys.meta_path.insert(0, self)
                elif type(sys.modules[root]).__name__ != 'Fake': return None
            except Exception: pass
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        class Fake(types.ModuleType):
            def __getattr__(self, attr):
                if attr.startswith('__'): raise AttributeError(attr)
                v = type(attr, (object,), {'__init__': lambda self, *a, **k: None}) if attr[:1].isupper() else mock.MagicMock(name=attr)
                setattr(self, attr, v); return v
        m = Fake(spec.name); m.__path__ = []; m.__spec__ = spec; m.__version__ = '99.0.0'; return m
    def exec_module(self, module): pass
import torch, torch._dynamo, torch._inductor.config, torch._dynamo.testing, torch._functorch.aot_autograd, torch.utils.flop_counter
try:
    import torch._inductor.utils, torch._higher_order_ops, torch.distributed, torch.distributed.fsdp, torch.distributed.tensor
except Exception: pass
sys.meta_path.insert(0, Finder())
import typing
if not hasattr(typing, "override"): typing.override = lambda f: f
sys.path.insert(0, sys.argv[1])
from megatron.training import arguments as A
captured = {}
orig = argparse.ArgumentParser.parse_args
def grab(self, *a, **k):
    captured['p'] = self; raise SystemExit(0)
argparse.ArgumentParser.parse_args = grab
argparse.ArgumentParser.parse_known_args = grab
try:
    A.parse_args(ignore_unknown_args=False)
except SystemExit:
    pass
p = captured['p']
names = set()
for act in p._actions:
    for s in act.option_strings:
        if s.startswith('--'): names.add(s)
for n in sorted(names): print(n)
