"""A simulated accelerator for CPU-only test runs: tensors "on" it compute on the CPU but report
another device, and any operation that mixes them with real CPU tensors fails exactly as CUDA does
("Expected all tensors to be on the same device"); ``.numpy()`` on them fails as it does on a GPU.

So code that builds a tensor on the CPU and multiplies it with device sums, or keeps a fit's rows
on one device and its parameters on another, fails here without a GPU. The device type is "lazy":
the one non-CPU type a CPU build of torch has device guards (and autograd) for; tensors on it are
wrapper subclasses holding a CPU tensor, and two modes route factories (``device=``) and moves
(``.to``, ``.cuda``) to it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DEVICE = torch.device("lazy", 0)
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


def _on_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on the simulated device."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=DEVICE,
            requires_grad=inner.requires_grad, storage_offset=inner.storage_offset())
        wrapper.inner = inner
        return wrapper

    def __repr__(self, **kwargs):
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_cpu = []

        def unwrap(value):
            if isinstance(value, OnDevice):
                return value.inner
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                on_cpu.append(value)
            return value

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if on_cpu and func not in _COPIES:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! (simulated, in {func})")
        leaving = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
            and not _on_device(kwargs["device"])
        if (func is torch.ops.aten._to_copy.default and "device" in kwargs) or _on_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")  # factories autograd calls with the device (a gradient's buffer)
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            # CUDA counts integers (transformers' grouped experts do); the CPU kernel takes floats only
            out = func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        else:
            out = func(*args, **kwargs)
        if leaving:
            return out
        return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t, out)


def _wrap(value):
    return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t, value)


class _Factories(TorchDispatchMode):
    """Tensors created with ``device=`` the simulated device (in torch's own code too)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(leaf, OnDevice) for leaf in tree_leaves((args, kwargs))):
            return OnDevice.__torch_dispatch__(func, types, args, kwargs)
        if _on_device(kwargs.get("device")):
            return _wrap(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        return func(*args, **kwargs)


class _Moves(TorchFunctionMode):
    """``.to(device)``, ``.cuda()`` and Python scalars of simulated tensors, which torch would
    otherwise refuse before dispatch for a device without kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            tensor = args[0]
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            if _on_device(device):
                base = tensor.inner if isinstance(tensor, OnDevice) else tensor
                with torch._C.DisableTorchFunctionSubclass():
                    moved = base.to(dtype) if dtype is not None else base
                if isinstance(tensor, OnDevice) and moved is base:
                    return tensor
                result = OnDevice((moved.clone() if moved is base else moved).detach())
                return result.requires_grad_(True) if tensor.requires_grad else result
        if name in ("__float__", "__int__", "__bool__", "__index__", "item", "tolist") and args \
                and isinstance(args[0], OnDevice):
            return func(args[0].inner, *args[1:], **kwargs)
        if _on_device(kwargs.get("device")):
            return _wrap(func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_accelerator():
    """Within the block, ``DEVICE`` behaves as a separate accelerator. ``module.float()`` and the like
    swap parameters whole (as torch does for subclasses that opt in), since assigning ``.data`` of a
    wrapper would change its reported dtype and not the tensor it wraps."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with _Moves(), _Factories():
            yield DEVICE
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
