"""RewardModelEnvironment scores equal a direct, unbatched forward of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from rl_envs.reward_model import RewardModelEnvironment

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
)
CORPUS = [
    "The capital of France is Paris.",
    "Two plus two equals four, and three times three is nine.",
    "I am happy to help you with your question about the weather.",
    "Sorry, I cannot help with that request.",
] * 20


def build_reward_model(out_dir: Path, num_labels: int = 1) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", chat_template=CHATML
    )
    tokenizer.save_pretrained(out_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("tiny_rm"))


CONVERSATIONS = [
    [("user", "What is the capital of France?"), ("assistant", "Paris.")],
    [("user", "What is two plus two?"), ("assistant", "Two plus two equals four, and that is all.")],
    [("system", "Be kind."), ("user", "Help me"), ("assistant", "Sorry, I cannot help with that request.")],
    [("user", "Weather?"), ("assistant", "I am happy to help you with your question about the weather.")],
    [("user", "x"), ("assistant", "")],
]


def as_log(turns: list[tuple[str, str]]) -> list[dict]:
    return [{"role": r, "content": c, "token_ids": torch.arange(2)} for r, c in turns]


def reference_scores(model_dir: Path) -> torch.Tensor:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    with torch.no_grad():
        for turns in CONVERSATIONS:
            text = tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in turns], tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            scores.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(scores)


def test_scores_equal_a_direct_forward_with_normalisation(model_dir: Path) -> None:
    expected = reference_scores(model_dir)
    assert expected.std() > 0  # distinct conversations get distinct scores
    env = RewardModelEnvironment({"model_path": str(model_dir), "batch_size": 2})
    ret = env.step([as_log(c) for c in CONVERSATIONS], [{}] * len(CONVERSATIONS))
    torch.testing.assert_close(ret.rewards, expected, atol=1e-5, rtol=1e-5)
    assert ret.terminateds.all() and ret.answers == [None] * len(CONVERSATIONS)

    normalised = RewardModelEnvironment(
        {"model_path": str(model_dir), "batch_size": 8, "score_mean": 0.3, "score_std": 2.0}
    )
    ret2 = normalised.step([as_log(c) for c in CONVERSATIONS], [{}] * len(CONVERSATIONS))
    torch.testing.assert_close(ret2.rewards, (expected - 0.3) / 2.0, atol=1e-5, rtol=1e-5)

    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards})
    assert metrics["mean_reward"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert metrics["std_reward"] == pytest.approx(float(expected.std(unbiased=False)), abs=1e-5)
    assert metrics["max_reward"] == pytest.approx(float(expected.max()), abs=1e-5)


def test_bad_model_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"env\.reward_model\.model_path: '/no/such/dir'"):
        RewardModelEnvironment({"model_path": "/no/such/dir"})
    two_labels = build_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModelEnvironment({"model_path": str(two_labels)})
    with pytest.raises(ValueError, match=r"(?s)env\.reward_model .*missing required key 'model_path'"):
        RewardModelEnvironment({})
