"""π0 folders and specs: the full-size PI0Config's size, a tiny checkpoint saved in transformers' PI0 layout
loading strictly through `load_pretrained` with its actions intact, the preflight, and the spec's `model.type:
pi0` (fields checked at load; runs in the runtime: test_pi0_runtime). Wall time ~10 s."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaslurm.models import CheckpointError, build_policy, check_checkpoint, load_pretrained
from vlaslurm.models.base import PolicyInput
from vlaslurm.models.pi0.build import tiny_pi0
from vlaslurm.models.pi0.flow import FlowSettings
from vlaslurm.models.pi0.policy import PI0Policy
from vlaslurm.spec import SpecError, load_spec
from vlaslurm.spec.model_types import PI0PolicyConfig

SETTINGS = FlowSettings(denoise_steps=3, noise_method="flow_noise")


def test_full_size_pi0_has_3_501_372_176_parameters() -> None:
    """The default PI0Config on the meta device (the paper's 3.3B plus the expert's embedding)."""
    from transformers import PI0Config, PI0ForConditionalGeneration

    with torch.device("meta"):
        model = PI0ForConditionalGeneration(PI0Config())
    assert sum(p.numel() for p in model.parameters()) == 3_501_372_176


def observations() -> PolicyInput:
    images = torch.randint(0, 256, (2, 1, 56, 56, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return PolicyInput(images, torch.ones(2, 3), ["stack the blocks", "close it"], torch.tensor([5, 6]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    policy = tiny_pi0(4, 3, 3, SETTINGS, seed=1)
    with torch.no_grad():  # heads away from their init, so that loading them is visible
        policy.value_head.bias.fill_(0.25)
        assert policy.noise_head is not None
        policy.noise_head.bias.fill_(-1.0)
    return policy, policy.save_pretrained(tmp_path_factory.mktemp("pi0") / "tiny pi0")


def test_a_saved_tiny_pi0_loads_strictly_with_the_same_actions(saved: tuple) -> None:
    from transformers import PI0ForConditionalGeneration

    policy, folder = saved
    assert json.loads((folder / "config.json").read_text())["model_type"] == "pi0"
    names = load_file(str(folder / "model.safetensors"))
    assert any(n.startswith("paligemma_with_expert.gemma_expert.") for n in names)  # lerobot's layout on disk
    loaded_with_info: Any = PI0ForConditionalGeneration.from_pretrained(
        folder, output_loading_info=True, local_files_only=True
    )
    info = loaded_with_info[1]
    assert not any(info.values()), info
    loaded = load_pretrained(folder)
    assert isinstance(loaded, PI0Policy) and loaded.settings == SETTINGS and loaded.action_dim == 3
    for deterministic in (True, False):
        a, b = policy.act(observations(), deterministic), loaded.act(observations(), deterministic)
        assert torch.equal(a.actions, b.actions) and torch.equal(a.value, b.value)
    assert loaded.noise_head is not None and torch.equal(loaded.noise_head.bias, policy.noise_head.bias)


def test_a_release_style_folder_loads_with_its_tokenizer_and_the_default_sampler(saved: tuple, tmp_path: Path) -> None:
    """A folder as a release ships it: PI0's config and weights and a tokenizer, none of vlaslurm's own files. It
    loads strictly with the release's tokenizer, the config's denoising steps, its max_action_dim and fresh heads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PI0ForConditionalGeneration

    from vlaslurm.models.pi0.inputs import ReleaseText

    policy, folder = saved
    release = tmp_path / "release"
    release.mkdir()
    for name in ("config.json", "model.safetensors"):
        (release / name).write_bytes((folder / name).read_bytes())
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "stack": 4, "the": 5, "blocks": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(release / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (release / "tokenizer_config.json").write_text(json.dumps(config))

    loaded = load_pretrained(release)
    assert isinstance(loaded, PI0Policy) and isinstance(loaded.text, ReleaseText)
    assert loaded.text.encode("stack the blocks") == [4, 5, 6] and loaded.text.bos_id == 2
    pi0_config = json.loads((folder / "config.json").read_text())
    assert loaded.settings == FlowSettings(denoise_steps=pi0_config["num_inference_steps"]) != SETTINGS
    assert loaded.action_dim == pi0_config["max_action_dim"]
    same = PI0ForConditionalGeneration.from_pretrained(folder, local_files_only=True).state_dict()
    assert all(torch.equal(t, same[k]) for k, t in loaded.pi0.state_dict().items())
    assert not torch.equal(loaded.value_head.bias, policy.value_head.bias)  # vlaslurm's heads stayed behind
    assert torch.isfinite(loaded.act(observations()).actions).all()


def test_a_folder_missing_a_tensor_does_not_load(saved: tuple, tmp_path: Path) -> None:
    _, folder = saved
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "vlaslurm_pi0.json"):
        (broken / name).write_text((folder / name).read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop(next(n for n in tensors if "gemma_expert" in n and "mlp" in n))
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not load strictly"):
        load_pretrained(broken)


def test_the_preflight_and_the_registry_read_a_pi0_folder(saved: tuple, tmp_path: Path) -> None:
    _, folder = saved
    check_checkpoint(PI0PolicyConfig(type="pi0", path=str(folder), action_chunk=4))
    (tmp_path / "config.json").write_text('{"model_type": "openvla"}')
    with pytest.raises(CheckpointError, match="model.path: .*model_type 'openvla'"):
        check_checkpoint(PI0PolicyConfig(type="pi0", path=str(tmp_path)))
    cfg = PI0PolicyConfig(type="pi0", path=str(folder), action_chunk=4, denoise_steps=3, noise_method="flow_noise")
    built = build_policy(cfg, action_dim=3, state_dim=3, image_size=56, num_cameras=1)
    assert isinstance(built, PI0Policy) and built.settings == SETTINGS
    with pytest.raises(ValueError, match="model.action_chunk is 8"):
        build_policy(PI0PolicyConfig(type="pi0", path=str(folder), action_chunk=8), 3, 3, 56, 1)
    fresh = build_policy(PI0PolicyConfig(type="pi0", action_chunk=2, denoise_steps=2), 2, 3, 56, 1)
    assert fresh.act(observations()).actions.shape == (2, 2, 2)


SPEC = """\
name: t
env: {{type: toy, num_envs: 4}}
model:
  type: pi0
  {field}
algo: {{type: ppo}}
rollout: {{mode: sync, total_env_steps: 100}}
"""


@pytest.mark.parametrize(
    "field,key",
    [("sde_steps: 11", "model.sde_steps"), ("noise_min: 0.5", "model.noise_min"), ("noise_method: ddim", "")],
)
def test_pi0_fields_are_checked_at_load_with_their_line(tmp_path: Path, field: str, key: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(SPEC.format(field=field)))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert "model." + field.split(":")[0] in str(err.value) and str(err.value.location) == f"{path}:5"
    assert key == "" or err.value.key == key
