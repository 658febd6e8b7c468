"""LoRA on the tiny release-named VLA: only adapters train, merging folds W + scale·B@A under the release's keys,
and peft's adapter folder round-trips (peft itself reads what save_adapter writes)."""

from __future__ import annotations

import json
from typing import Dict, Optional

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn

from vlaslurm.models.prismatic.lora import (
    ADAPTER_FILES,
    COMPONENTS,
    AdapterError,
    LoraSettings,
    LoraSettingsError,
    adapter_base_path,
    adapter_state_dict,
    apply_lora,
    is_adapter_folder,
    load_adapter,
    lora_layers,
    merged_state_dict,
    save_adapter,
)
from vlaslurm.models.prismatic.release import build_vla, tiny_release_config
from vlaslurm.models.prismatic.vla import PrismaticVLA

Q_PROJ = "language_model.model.layers.0.self_attn.q_proj"
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# RLinf's LoRA target list (rlinf/models/__init__.py), applied to the whole model, less "out_proj": RLinf shares the
# list between model types and that name matches nothing in OpenVLA, which lora.py refuses.
RLINF_TARGETS = ("proj", "qkv", "fc1", "fc2", "q", "kv", "fc3", *LLAMA_LINEARS, "lm_head")


@pytest.fixture(scope="module")
def base_state() -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build_vla(tiny_release_config(), device="cpu").state_dict()


def fresh(base_state: Dict[str, torch.Tensor]) -> PrismaticVLA:
    vla = build_vla(tiny_release_config(), device="cpu")
    vla.load_state_dict(base_state, strict=True)
    return vla.eval()


def lora_vla(base_state: Dict[str, torch.Tensor], settings: Optional[LoraSettings] = None, seed: int = 1) -> nn.Module:
    """The base with adapters whose B is random too (a fresh B is zero, which would make every check trivial)."""
    vla = apply_lora(fresh(base_state), settings or LoraSettings())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(vla).values():
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    return vla


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(2)
    pixels = torch.randn(1, 6, 224, 224, generator=generator)
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.randint(3, 32000, (1, 6), generator=generator)], 1)
    return pixels, ids


def logits(vla: nn.Module, inputs) -> torch.Tensor:
    with torch.no_grad():
        return vla(*inputs)


@pytest.fixture(scope="module")
def adapted(base_state) -> nn.Module:
    """Default settings, random B; shared by the tests that only read it."""
    return lora_vla(base_state)


@pytest.fixture(scope="module")
def expected(adapted, inputs) -> torch.Tensor:
    return logits(adapted, inputs)


def test_only_adapters_get_gradients(base_state, inputs):
    vla = lora_vla(base_state)
    trainable = {name for name, p in vla.named_parameters() if p.requires_grad}
    expected = {
        f"language_model.model.layers.{i}.{block}.{linear}.lora_{ab}.default.weight"
        for i in range(2)
        for block, linears in (("self_attn", LLAMA_LINEARS[:4]), ("mlp", LLAMA_LINEARS[4:]))
        for linear in linears
        for ab in "AB"
    }
    assert trainable == expected  # "all-linear" in the language model: no lm_head, no towers, no projector
    vla.train()
    vla(*inputs)[:, -3:].logsumexp(-1).sum().backward()
    with_grad = {name for name, p in vla.named_parameters() if p.grad is not None}
    assert with_grad == expected
    assert all(vla.get_parameter(name).grad.abs().sum() > 0 for name in expected)


def test_trainable_extra_and_rlinf_targets(base_state):
    settings = LoraSettings(target_modules=RLINF_TARGETS, scope=COMPONENTS, trainable_extra=("projector",))
    vla = apply_lora(fresh(base_state), settings)
    layers = lora_layers(vla)
    assert "language_model.lm_head" in layers and "projector.fc3" in layers
    assert "vision_backbone.featurizer.blocks.0.attn.qkv" in layers
    assert "vision_backbone.featurizer.patch_embed.proj" not in layers  # a Conv2d: only linear layers are adapted
    frozen_extra = [n for n, p in vla.named_parameters() if n.startswith("projector.") and not p.requires_grad]
    assert frozen_extra == []
    others = [n for n, p in vla.named_parameters() if p.requires_grad and not n.startswith("projector.")]
    assert others and all(".lora_A." in n or ".lora_B." in n for n in others)


def test_merged_weight_is_base_plus_scaled_b_times_a(base_state, adapted):
    vla = adapted
    layer = lora_layers(vla)[Q_PROJ]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.shape == (32, 64) and b.shape == (64, 32) and b.abs().sum() > 0
    merged = merged_state_dict(vla)
    by_hand = base_state[f"{Q_PROJ}.weight"] + (16 / 32) * (b @ a)
    torch.testing.assert_close(merged[f"{Q_PROJ}.weight"], by_hand, rtol=0, atol=1e-6)
    for key in ("language_model.lm_head.weight", "projector.fc1.bias", "vision_backbone.featurizer.cls_token"):
        assert torch.equal(merged[key], base_state[key])  # not adapted: the base tensor as it was
    assert lora_layers(vla) and f"{Q_PROJ}.base_layer.weight" in vla.state_dict()  # merging left the model as is


def test_merged_state_dict_loads_strictly_into_a_fresh_vla(base_state, adapted, expected, inputs):
    merged = merged_state_dict(adapted)
    assert list(merged) == list(base_state)  # exactly the release's keys, in its order
    assert not torch.allclose(merged[f"{Q_PROJ}.weight"], base_state[f"{Q_PROJ}.weight"])
    plain = build_vla(tiny_release_config(), device="cpu").eval()
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(logits(plain, inputs), expected, rtol=1e-4, atol=1e-4)


def test_adapter_folder_round_trip(base_state, adapted, expected, inputs, tmp_path):
    vla = adapted
    folder = tmp_path / "adapter 'step 3'"  # a space and quotes on purpose
    base_path = tmp_path / "openvla 7b"
    assert save_adapter(vla, folder, base_path) == folder
    assert sorted(p.name for p in folder.iterdir()) == sorted(ADAPTER_FILES) and is_adapter_folder(folder)
    assert adapter_base_path(folder) == str(base_path)
    stored = load_file(str(folder / "adapter_model.safetensors"))
    assert set(stored) == {f"base_model.model.{key}" for key in adapter_state_dict(vla)}
    assert f"base_model.model.{Q_PROJ}.lora_A.weight" in stored  # peft's saved names: no adapter name
    loaded = load_adapter(fresh(base_state), folder)
    assert torch.equal(logits(loaded, inputs), expected)
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == {
        n for n, p in vla.named_parameters() if p.requires_grad
    }
    again = load_adapter(apply_lora(fresh(base_state), LoraSettings()), folder)  # into existing adapters
    assert torch.equal(logits(again, inputs), expected)
    by_peft = PeftModel.from_pretrained(fresh(base_state), str(folder))  # peft's own reader agrees
    torch.testing.assert_close(logits(by_peft, inputs), expected, rtol=0, atol=1e-6)


def test_adapter_folder_errors(base_state, adapted, tmp_path):
    vla = adapted
    folder = tmp_path / "adapter"
    save_adapter(vla, folder, "base")
    assert not is_adapter_folder(tmp_path) and not is_adapter_folder(folder / "adapter_config.json")
    with pytest.raises(AdapterError, match="is not an adapter folder: adapter_config.json, adapter_model"):
        load_adapter(fresh(base_state), tmp_path)
    with pytest.raises(AdapterError, match=r"another adapter than the model's: r 32 \(model: 8\)"):
        load_adapter(apply_lora(fresh(base_state), LoraSettings(rank=8)), folder)
    with pytest.raises(AdapterError, match="already has LoRA adapters"):
        apply_lora(vla, LoraSettings())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    missing = f"base_model.model.{Q_PROJ}.lora_B.weight"
    del tensors[missing]
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=f"missing key\\(s\\): '{missing.removeprefix('base_model.model.')}'"):
        load_adapter(fresh(base_state), folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora is not supported"):
        load_adapter(fresh(base_state), folder)
    with pytest.raises(AdapterError, match="has no LoRA adapters"):
        merged_state_dict(fresh(base_state))


def settings_error(**fields) -> str:
    with pytest.raises(LoraSettingsError) as info:
        LoraSettings(**fields)
    return str(info.value)


def test_settings_errors_name_the_field(base_state):
    assert LoraSettings().scale == 0.5 and LoraSettings(target_modules=["q_proj"]).target_modules == ("q_proj",)
    assert "lora.rank must be a positive integer, got int 0" in settings_error(rank=0)
    assert "lora.rank must be a positive integer, got bool True" in settings_error(rank=True)
    assert "lora.alpha must be a positive number, got int -1" in settings_error(alpha=-1)
    assert "lora.dropout must be a number in [0, 1), got float 1.0" in settings_error(dropout=1.0)
    assert "lora.target_modules is 'all'; give 'all-linear' or a list" in settings_error(target_modules="all")
    assert "lora.target_modules is empty" in settings_error(target_modules=())
    assert "lora.target_modules[1] must be a non-empty string" in settings_error(target_modules=("q_proj", ""))
    assert "lora.scope[1] is 'projecter' (did you mean projector?)" in settings_error(
        scope=("language_model", "projecter")
    )
    assert "lora.init is 'uniform'; valid values: gaussian, kaiming" in settings_error(init="uniform")
    with pytest.raises(LoraSettingsError, match=r"lora.target_modules\[1\] is 'q_projj'.*did you mean q_proj"):
        apply_lora(fresh(base_state), LoraSettings(target_modules=("v_proj", "q_projj")))
    with pytest.raises(LoraSettingsError, match=r"lora.trainable_extra\[0\] is 'projecter'.*did you mean projector"):
        apply_lora(fresh(base_state), LoraSettings(trainable_extra=("projecter",)))
