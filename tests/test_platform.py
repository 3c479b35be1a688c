"""The platform layer (nanovllm/platform/): chosen once from the config, handed to the layers while
a model is built (and only then), the reference path plain torch, and the CPU's per-layer state on
each layer's linear method rather than on the layer classes."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.config import Config
from nanovllm.kernels import cpu_build
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from nanovllm.platform.choose import choose_platform
from nanovllm.platform.context import REFERENCE, building_for, current_platform
from nanovllm.platform.cpu import CpuPlatform, CpuTorchPlatform
from nanovllm.platform.cpu.linear import CpuLinearMethod, CpuLmHeadMethod
from nanovllm.platform.torch import TorchPlatform, UnquantizedLinearMethod


def test_the_config_chooses_the_platform(qwen3_tiny, monkeypatch):
    assert type(choose_platform(Config(qwen3_tiny, device="cpu", fused_kernels="torch"))) is CpuTorchPlatform
    monkeypatch.setattr(cpu_build, "load_fused", lambda: "no C++ compiler found")
    config = Config(qwen3_tiny, device="cpu", fused_kernels="cpu")
    assert type(choose_platform(config)) is CpuTorchPlatform and config.fused_kernels == "torch"


def test_the_cpu_platform_with_its_kernels(qwen3_tiny, cpu_kernels):
    platform = choose_platform(Config(qwen3_tiny, device="cpu", fused_kernels="cpu"))
    assert type(platform) is CpuPlatform and isinstance(platform.kernels, cpu_build.FusedKernels)
    assert platform.name == "cpu"


def test_layers_take_the_platform_they_are_built_for_and_only_then():
    platform = CpuTorchPlatform(torch.float32)
    with building_for(platform):
        assert current_platform() is platform
        norm, act, linear, head = RMSNorm(8), SiluAndMul(), ColumnParallelLinear(8, 16), ParallelLMHead(32, 8)
        with pytest.raises(RuntimeError, match="does not nest"):
            with building_for(REFERENCE):
                pass
    assert current_platform() is REFERENCE
    assert norm.platform is act.platform is platform
    assert type(linear.linear_method) is CpuLinearMethod and type(head.linear_method) is CpuLmHeadMethod
    assert type(RowParallelLinear(8, 4).linear_method) is UnquantizedLinearMethod  # built outside: the reference


def test_the_reference_linear_is_f_linear_and_layers_declare_no_cpu_state():
    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(16, 24, bias=True)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen))
    x = torch.randn(3, 16, generator=gen)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    assert not {"packed_weight", "few_rows", "amx", "half_rows", "enable_cpu"} & set(dir(LinearBase))


def test_the_cpu_method_keeps_the_packed_weight_on_itself():
    """After loading, the CPU platform packs each linear layer's weight for oneDNN (where torch has
    oneDNN) on that layer's method; the product stays F.linear's to rounding."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch has no oneDNN here")
    platform = CpuTorchPlatform(torch.float32)
    with building_for(platform):
        model = torch.nn.Module()
        model.proj = ColumnParallelLinear(64, 48)
    torch.nn.init.normal_(model.proj.weight)
    line = platform.prepare_model(model)
    assert model.proj.linear_method.packed is not None and "1 packed for oneDNN" in line
    x = torch.randn(5, 64)
    torch.testing.assert_close(model.proj(x), F.linear(x, model.proj.weight), atol=1e-5, rtol=1e-5)


def test_the_reference_platform_draws_by_the_race_and_the_cpu_by_inverse_transform(monkeypatch):
    from nanovllm.layers import sampler
    calls = []
    monkeypatch.setattr(sampler, "exponential_noise", lambda w, t: calls.append("race") or torch.ones_like(w))
    monkeypatch.setattr(sampler, "uniforms", lambda rows, t, device: calls.append("inverse") or torch.zeros(rows))
    weights = torch.tensor([[0.0, 2.0, 1.0]])
    assert TorchPlatform().draw(weights, None).tolist() == [1]
    assert CpuTorchPlatform(torch.float32).draw(weights, None).tolist() == [1]
    assert calls == ["race", "inverse"]
