"""Multi-turn rollouts with a real tiny model (the HF sampler in-process) and a scripted
environment: turn structure, termination, turn limits, the length budget, and the generation
log-probs checked against a teacher-forced forward of the same model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos.data.chat import tokenize_conversation
from rl_algos.data.collate import flatten_message_log
from rl_algos.models.tiny import build_tiny_causal_lm, build_tokenizer
from rl_algos.rollouts import run_multi_turn_rollout
from rl_core.data import BatchedDataDict
from rl_core.interfaces import EnvironmentInterface, EnvironmentReturn, GenerationInterface, WeightBucket
from rl_core.policy.config import SamplingConfig
from rl_dtensor.sampling import generate_batch

MAX_NEW_TOKENS = 12


class InProcessHFGeneration(GenerationInterface):
    """The Hugging Face sampler the generation workers run, on a model in this process."""

    def __init__(self, model_dir: Path, sampling: SamplingConfig, max_total_length: int, seed: int) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.sampling = sampling
        self.max_total_length = max_total_length
        self.generator = torch.Generator().manual_seed(seed)
        self.calls: list[int] = []  # batch size of each generate call

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        self.calls.append(int(data["input_ids"].shape[0]))
        return BatchedDataDict(
            generate_batch(
                self.model,
                self.tokenizer,
                data["input_ids"],
                data["input_lengths"],
                self.sampling,
                self.max_total_length,
                greedy=greedy,
                stop_strings=data.get("stop_strings"),
                generator=self.generator,
            )
        )

    def prepare_for_generation(self, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, **kwargs: Any) -> bool:
        return True

    def update_weights(self, buckets: Iterable[WeightBucket]) -> bool:
        return True

    def shutdown(self) -> bool:
        return True


class CountdownEnvironment(EnvironmentInterface):
    """Ends the episode after `metadata["turns"]` replies; 0.1 reward per reply, +1 at the end."""

    def step(self, message_log_batch: list[Any], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        observations, next_metadata, rewards, done = [], [], [], []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            replies = sum(1 for m in log if m["role"] == "assistant" and "generation_logprobs" in m)
            finished = replies >= meta["turns"]
            observations.append({"role": "environment", "content": f"reply {replies} received"})
            next_metadata.append(None if finished else {**meta, "seen": replies})
            rewards.append(1.1 if finished else 0.1)
            done.append(finished)
        n = len(message_log_batch)
        return EnvironmentReturn(
            observations, next_metadata, [None] * n, torch.tensor(rewards), torch.tensor(done), [None] * n
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        return batch, {}


class LocalStepper:
    """Steps the environment object directly (the Ray router does the same through actors)."""

    def __init__(self, env: EnvironmentInterface) -> None:
        self.env = env
        self.metadata_seen: list[list[dict[str, Any]]] = []

    def step(
        self, message_log_batch: list[Any], metadata: list[dict[str, Any]], task_names: Sequence[str]
    ) -> EnvironmentReturn:
        assert set(task_names) == {"countdown"}
        self.metadata_seen.append([dict(m) for m in metadata])
        return self.env.step(message_log_batch, metadata)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rollout_model")
    corpus = [f"reply {i} received. What is {i} + {i}?" for i in range(200)]
    build_tokenizer(corpus, vocab_size=300, out_dir=root / "tokenizer")
    return build_tiny_causal_lm(root / "tokenizer", root / "model", hidden_size=32, intermediate_size=64)


def make_generation(model_dir: Path, max_total_length: int = 256) -> InProcessHFGeneration:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Every even token id ends a reply: replies are short, of varying length, and end by a
    # stop token rather than by the length limit.
    stop_ids = [i for i in range(len(tokenizer)) if i % 2 == 0]
    sampling = SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop_ids)
    return InProcessHFGeneration(model_dir, sampling, max_total_length, seed=0)


def prompt_batch(tokenizer: Any, turns: list[int]) -> BatchedDataDict[Any]:
    logs = [
        tokenize_conversation(
            tokenizer, [{"role": "user", "content": f"count {n}"}], add_generation_prompt=True
        )
        for n in turns
    ]
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"turns": n} for n in turns],
        task_name=["countdown"] * len(turns),
    )


def teacher_forced_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), logprobs])


def test_multi_turn_structure_rewards_and_logprobs(model_dir: Path) -> None:
    generation = make_generation(model_dir)
    tokenizer = generation.tokenizer
    batch = prompt_batch(tokenizer, [1, 2, 3, 5])
    stepper = LocalStepper(CountdownEnvironment())
    result = run_multi_turn_rollout(
        generation, batch, tokenizer, stepper, max_rollout_turns=3, max_seq_len=256
    )
    out = result.batch
    assert out["num_turns"].tolist() == [1, 2, 3, 3]
    assert out["terminated"].tolist() == [True, True, True, False]
    assert out["truncated"].tolist() == [False, False, False, False]
    assert out["total_reward"].tolist() == pytest.approx([1.1, 1.2, 1.3, 0.3])
    # Each turn generated for the conversations still going, in one batched call.
    assert generation.calls == [4, 3, 2]
    # The environment received its own metadata from the previous turn.
    assert stepper.metadata_seen[1] == [
        {"turns": 2, "seen": 1},
        {"turns": 3, "seen": 1},
        {"turns": 5, "seen": 1},
    ]
    # The input batch is left as it was.
    assert [len(log) for log in batch["message_log"]] == [1, 1, 1, 1]

    for log, turns in zip(out["message_log"], out["num_turns"].tolist(), strict=True):
        roles = [m["role"] for m in log]
        assert roles == ["user", *(["assistant", "environment"] * (turns - 1)), "assistant"]
        generated = [m for m in log if m["role"] == "assistant"]
        assert all(m["generation_logprobs"].shape == m["token_ids"].shape for m in generated)
        assert all(1 <= m["token_ids"].numel() <= MAX_NEW_TOKENS for m in generated)
        assert all(int(m["token_ids"][-1]) % 2 == 0 for m in generated)  # ended by a stop token
        # The observation is the chat template's user turn (the "environment" role is aliased),
        # followed by the next assistant header.
        flat = flatten_message_log(log)
        text = tokenizer.decode(flat.tolist(), skip_special_tokens=False)
        for k in range(1, turns):
            assert f"<|im_start|>user\nreply {k} received<|im_end|>\n<|im_start|>assistant\n" in text
        # Generation log-probs equal the model's log-probs of the same tokens, teacher-forced
        # over the whole multi-turn sequence.
        reference = teacher_forced_logprobs(generation.model, flat)
        mask = flatten_message_log(log, "token_mask") > 0
        got = flatten_message_log(log, "generation_logprobs")
        assert int(mask.sum()) == sum(m["token_ids"].numel() for m in generated)
        torch.testing.assert_close(got[mask], reference[mask], atol=2e-5, rtol=0)
    assert out["response_length"].tolist() == [
        sum(m["token_ids"].numel() for m in log if m["role"] == "assistant") for log in out["message_log"]
    ]
    assert result.metrics["mean_turns"] == pytest.approx(9 / 4)
    assert result.metrics["turn_2/active_samples"] == 3.0
    # Turn 3: the 3-turn episode ends (1.1), the 5-turn one goes on (0.1).
    assert result.metrics["turn_3/mean_reward"] == pytest.approx(0.6)


def test_length_budget_ends_the_episode_without_overflowing(model_dir: Path) -> None:
    generation = make_generation(model_dir)
    tokenizer = generation.tokenizer
    batch = prompt_batch(tokenizer, [4, 4])
    prompt_length = int(batch["message_log"][0][0]["token_ids"].numel())
    max_seq_len = prompt_length + 2 * MAX_NEW_TOKENS
    generation.max_total_length = max_seq_len
    result = run_multi_turn_rollout(
        generation,
        batch,
        tokenizer,
        LocalStepper(CountdownEnvironment()),
        max_rollout_turns=10,
        max_seq_len=max_seq_len,
    )
    out = result.batch
    assert out["truncated"].tolist() == [True, True]
    assert out["terminated"].tolist() == [False, False]
    for log in out["message_log"]:
        length = sum(int(m["token_ids"].numel()) for m in log)
        assert length <= max_seq_len
        # The conversation ends with a reply: an observation that leaves no room is dropped.
        assert log[-1]["role"] == "assistant"


def test_prompt_at_the_length_limit_is_not_generated_for(model_dir: Path) -> None:
    generation = make_generation(model_dir)
    tokenizer = generation.tokenizer
    batch = prompt_batch(tokenizer, [1, 1])
    prompt_length = int(batch["message_log"][0][0]["token_ids"].numel())
    result = run_multi_turn_rollout(
        generation,
        batch,
        tokenizer,
        LocalStepper(CountdownEnvironment()),
        max_rollout_turns=2,
        max_seq_len=prompt_length,
    )
    assert generation.calls == []
    assert result.batch["truncated"].tolist() == [True, True]
    assert result.batch["num_turns"].tolist() == [0, 0]
    assert result.batch["total_reward"].tolist() == [0.0, 0.0]
