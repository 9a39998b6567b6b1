"""torch.library custom ops over the compiled core: the only package that calls coat._C.

One module per kernel family, mirroring csrc/bindings/ (import the family module you need:
``from coat._ops import quantize``). Every op is functional (returns new tensors, or declares
what it mutates) and has a fake implementation, so it works under torch.compile and FakeTensor
tracing. FP8 data crosses into the core as uint8 views.
"""
