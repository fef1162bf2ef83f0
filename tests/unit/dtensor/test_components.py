"""rl-dtensor building blocks that need no process group: config validation and errors, model
loading errors, LR schedules, sampling filters, refit buckets, the tiny model builder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dtensor_testing import make_batch, policy_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos.models.tiny import arithmetic_corpus, build_tiny_causal_lm, build_tokenizer
from rl_core.config import ConfigError, validate_config
from rl_core.ops import token_logprobs
from rl_core.policy.batching import check_sequence_lengths, sharding_args
from rl_core.policy.config import PolicyConfig, SamplingConfig
from rl_core.policy.optim import build_optimizer, lr_multiplier
from rl_core.policy.refit import plan_buckets
from rl_dtensor.forward import additive_mask
from rl_dtensor.model_loading import ModelLoadError, load_causal_lm, load_tokenizer
from rl_dtensor.sampling import filter_logits

# ----------------------------------------------------------------------------------- config


def test_unknown_optimizer_name_lists_the_valid_ones(tiny_model_dir):
    config = policy_config(tiny_model_dir, optimizer={"name": "adamx"})
    with pytest.raises(ConfigError) as info:
        validate_config(config, PolicyConfig, source="recipe.yaml")
    message = str(info.value)
    assert "recipe.yaml" in message and "optimizer.name" in message
    assert "unknown optimizer name 'adamx'; valid names: adam, adamw, sgd" in message
    with pytest.raises(ValueError, match="unknown optimizer name 'lion'; valid names: adam, adamw, sgd"):
        build_optimizer("lion", [torch.nn.Parameter(torch.zeros(1))], {})


def test_bad_optimizer_kwargs_name_the_optimizer():
    with pytest.raises(
        ValueError, match=r"optimizer 'adamw' \(AdamW\) rejected optimizer.kwargs \{'lrr': 0.1\}"
    ):
        build_optimizer("adamw", [torch.nn.Parameter(torch.zeros(1))], {"lrr": 0.1})


def test_config_rejects_unknown_keys_and_conflicting_batching(tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"unknown key 'dtensor\.tp_sise' \(did you mean 'dtensor\.tp_size'\?\)"
    ):
        validate_config(policy_config(tiny_model_dir, dtensor={"tp_sise": 2}), PolicyConfig)
    both = policy_config(
        tiny_model_dir, dynamic_batching={"enabled": True}, sequence_packing={"enabled": True}
    )
    with pytest.raises(ConfigError, match="dynamic_batching and sequence_packing cannot both be enabled"):
        validate_config(both, PolicyConfig)
    with pytest.raises(ConfigError, match="scheduler 'cosine' needs total_steps"):
        validate_config(policy_config(tiny_model_dir, scheduler={"name": "cosine"}), PolicyConfig)


def test_sampling_overrides_are_validated():
    base = SamplingConfig(temperature=0.7, stop_strings=["\n"])
    merged = base.with_overrides({"max_new_tokens": 5})
    assert (merged.temperature, merged.max_new_tokens, merged.stop_strings) == (0.7, 5, ["\n"])
    with pytest.raises(ValueError, match="top_q"):
        base.with_overrides({"top_q": 0.5})


def test_sharding_args_follow_config(tiny_model_dir):
    config = PolicyConfig.model_validate(
        policy_config(
            tiny_model_dir,
            dtensor={"tp_size": 2, "sequence_parallel": True},
            sequence_packing={"enabled": True, "train_mb_tokens": 128, "logprob_mb_tokens": 256},
        )
    )
    dynamic, packing = sharding_args(config, "train")
    assert dynamic is None and packing is not None
    assert (packing.max_tokens_per_microbatch, packing.sequence_length_pad_multiple) == (128, 2)
    assert sharding_args(config, "logprob")[1].max_tokens_per_microbatch == 256


# ----------------------------------------------------------------------------- input errors


def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(
        ModelLoadError, match=r"model '.*no_such_model' is neither a local directory nor reachable"
    ):
        load_causal_lm(str(missing), torch.float32)
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file, not a model directory"):
        load_tokenizer(str(a_file))


def test_sequence_longer_than_max_total_length_is_named():
    batch = make_batch(50, [5, 12, 30], [1, 1, 1], [1, 1, 1])
    check_sequence_lengths(batch, 30)
    with pytest.raises(
        ValueError, match=r"sample 1 has 12 tokens, more than max_total_sequence_length=10 \(2 sample"
    ):
        check_sequence_lengths(batch, 10)


# ---------------------------------------------------------------------------------- numerics


def test_lr_schedules_closed_form():
    linear = lr_multiplier("linear", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert [linear(s) for s in (0, 1, 2, 6, 10, 50)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    cosine = lr_multiplier("cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 8))
    assert [cosine(s) for s in (2, 4, 6, 10)] == pytest.approx([1.0, expected, 0.55, 0.1])
    constant = lr_multiplier("constant", warmup_steps=4, total_steps=None, min_lr_ratio=0.0)
    assert [constant(s) for s in (0, 3, 100)] == pytest.approx([0.25, 1.0, 1.0])


def test_token_logprobs_definition():
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    out = token_logprobs(logits, ids, temperature=0.5)
    for b in range(2):
        assert out[b, 0] == 0
        for t in range(1, 4):
            expected = torch.log_softmax(logits[b, t - 1] / 0.5, dim=-1)[ids[b, t]]
            assert float(out[b, t]) == pytest.approx(float(expected), abs=1e-6)


def test_additive_mask_blocks_with_dtype_min():
    allowed = torch.tensor([[True, False], [True, True]])
    mask = additive_mask(allowed, torch.bfloat16)
    assert mask.dtype == torch.bfloat16
    assert mask[0, 0] == 0 and mask[0, 1] == torch.finfo(torch.bfloat16).min


@pytest.mark.parametrize("seed", range(5))
def test_top_k_and_top_p_keep_exactly_the_right_tokens(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 20, generator=generator) * 2
    kept_k = filter_logits(logits, top_k=4, top_p=1.0).isfinite()
    for row in range(3):
        assert set(kept_k[row].nonzero().flatten().tolist()) == set(
            torch.topk(logits[row], 4).indices.tolist()
        )
    kept_p = filter_logits(logits, top_k=None, top_p=0.6).isfinite()
    probs = torch.softmax(logits, dim=-1)
    for row in range(3):
        order = torch.argsort(probs[row], descending=True).tolist()
        nucleus, mass = [], 0.0
        for token in order:  # smallest prefix of the sorted tokens with mass >= top_p
            nucleus.append(token)
            mass += float(probs[row, token])
            if mass >= 0.6:
                break
        assert set(kept_p[row].nonzero().flatten().tolist()) == set(nucleus)
    assert bool(filter_logits(logits, top_k=None, top_p=1.0).isfinite().all())


def test_refit_bucket_plan():
    info = {
        "a": ((10,), "float32"),
        "b": ((30,), "float32"),
        "c": ((5,), "bfloat16"),
        "d": ((100,), "float32"),
    }
    assert plan_buckets(info, 160) == [["a", "b"], ["c"], ["d"]]
    assert plan_buckets(info, 10_000) == [["a", "b", "c", "d"]]
    with pytest.raises(ValueError, match="bucket_size_bytes must be positive"):
        plan_buckets(info, 0)


# --------------------------------------------------------------------------------- tiny model


def test_tiny_model_builder(tiny_model_dir: Path, tiny_llama_tied_dir: Path, tmp_path: Path):
    size = sum(f.stat().st_size for f in tiny_model_dir.iterdir())
    assert size < 1_000_000
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert model.config.vocab_size == len(tokenizer) == 384
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (2, 64)
    text = "What is 731 + 5? The answer is 736. ünïcode"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer(text)["input_ids"]) < len(text.encode())  # merges were learnt
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    tied = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied_dir))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    # Same arguments, same weights.
    again = build_tiny_causal_lm(tiny_model_dir, tmp_path / "again")
    again_params = dict(AutoModelForCausalLM.from_pretrained(str(again)).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, again_params[name]), name
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        build_tokenizer(arithmetic_corpus(10), 100, tmp_path / "tok")
