"""The `rl` command: `rl <algorithm> [--config RECIPE] [key=value ...]`.

Algorithms are subcommands registered in `SUBCOMMANDS` (one entry each: the recipe schema,
the function that runs it, the packaged default recipe), so adding one is adding an entry.
The command parses its arguments and validates the recipe before it starts anything heavy
(Ray, models, data processing); a bad recipe, override or dataset ends the run with exit
status 2 and one message naming the culprit, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.resources
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.config import ConfigError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
RECIPES_PACKAGE = "rl_algos.recipes"


@dataclass(frozen=True)
class Subcommand:
    """One algorithm of the `rl` command.

    `schema` and `runner` are `module:attribute` strings, imported only when the subcommand
    runs: the recipe's pydantic model, and the function that takes the validated recipe.
    """

    name: str
    help: str
    schema: str
    runner: str
    default_recipe: str | None = None
    description: str = ""


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(subcommand: Subcommand, *, replace: bool = False) -> None:
    if subcommand.name in SUBCOMMANDS and not replace:
        raise ValueError(f"subcommand {subcommand.name!r} is already registered")
    SUBCOMMANDS[subcommand.name] = subcommand


register_subcommand(
    Subcommand(
        name="grpo",
        help="GRPO / DAPO / GSPO reinforcement learning",
        schema="rl_algos.grpo:GRPOMasterConfig",
        runner="rl_algos.grpo:run_grpo",
        default_recipe="grpo_tiny_cpu.yaml",
        description=(
            "Train a policy with GRPO (DAPO and GSPO through the grpo/loss_fn settings). Without "
            "--config it runs the built-in CPU recipe: it builds a tiny model and tokenizer, warm-starts "
            "it on the arithmetic task (cached under $RL_CACHE_DIR or ~/.cache/rl), then trains it with "
            "GRPO against the math environment and reports the validation accuracy curve."
        ),
    )
)

register_subcommand(
    Subcommand(
        name="sft",
        help="supervised fine-tuning (NLL on assistant turns)",
        schema="rl_algos.sft:SFTMasterConfig",
        runner="rl_algos.sft:run_sft",
        default_recipe="sft_tiny_cpu.yaml",
        description=(
            "Fine-tune a policy on prompt/completion or OpenAI-messages data (local JSONL/JSON/Parquet, a "
            "Hugging Face dataset, or the built-in arithmetic task); only assistant tokens are trained on. "
            "Without --config it trains a freshly built tiny model on the arithmetic task's worked solutions."
        ),
    )
)
register_subcommand(
    Subcommand(
        name="dpo",
        help="direct preference optimisation on prompt/chosen/rejected data",
        schema="rl_algos.dpo:DPOMasterConfig",
        runner="rl_algos.dpo:run_dpo",
        default_recipe="dpo_tiny_cpu.yaml",
        description=(
            "Train a policy with DPO (optional SFT term on the chosen responses) against its frozen initial "
            "weights. Without --config it trains the tiny arithmetic model to prefer right worked solutions "
            "to wrong ones."
        ),
    )
)
register_subcommand(
    Subcommand(
        name="rm",
        help="reward-model training (Bradley-Terry) on prompt/chosen/rejected data",
        schema="rl_algos.rm:RMMasterConfig",
        runner="rl_algos.rm:run_rm",
        default_recipe="rm_tiny_cpu.yaml",
        description=(
            "Train a sequence-classification reward model (a causal LM with a one-output head) with the "
            "pairwise Bradley-Terry loss; the exported model scores conversations in the reward_model "
            "environment."
        ),
    )
)
register_subcommand(
    Subcommand(
        name="distill",
        help="on-policy distillation from a teacher's top-k logits",
        schema="rl_algos.distill:DistillMasterConfig",
        runner="rl_algos.distill:run_distill",
        default_recipe=None,
        description=(
            "The student generates, the teacher scores the student's sequences (top-k logits) and the "
            "student minimises the forward, reverse or mixed KL to the teacher. Student and teacher must "
            "share a vocabulary. Needs --config (e.g. distill_tiny_cpu) and the two model directories."
        ),
    )
)
register_subcommand(
    Subcommand(
        name="eval",
        help="pass@k / cons@k evaluation of a model directory",
        schema="rl_algos.eval:EvalMasterConfig",
        runner="rl_algos.eval:run_eval",
        default_recipe="eval_tiny_cpu.yaml",
        description=(
            "Answer each prompt of a dataset num_tests_per_prompt times, score the answers with an "
            "environment (math by default), print pass@k and cons@k and write them, per prompt too, to a "
            "JSON file. Give the model as model.model_name=DIR."
        ),
    )
)

_OVERRIDE_HELP = """\
overrides (applied in order, after the recipe's `defaults:`):
  key.path=value     replace a key the recipe or its schema has, e.g. grpo.max_num_steps=20
  +key.path=value    add a key that does not exist yet
  ++key.path=value   add or replace
  ~key.path          delete
values are YAML: 8, 1.5e-3, true, null, [1, 2], {k: v}
"""


def packaged_recipe(name: str) -> Path:
    return Path(str(importlib.resources.files(RECIPES_PACKAGE).joinpath(name)))


def packaged_recipes() -> list[str]:
    return sorted(
        p.name for p in importlib.resources.files(RECIPES_PACKAGE).iterdir() if p.name.endswith(".yaml")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl",
        description="Post-training for language models: GRPO-family RL, SFT, DPO, reward models, distillation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for subcommand in SUBCOMMANDS.values():
        default = (
            f"packaged recipe {subcommand.default_recipe}" if subcommand.default_recipe else "none; required"
        )
        sub = commands.add_parser(
            subcommand.name,
            help=subcommand.help,
            description=subcommand.description or subcommand.help,
            epilog=_OVERRIDE_HELP + f"packaged recipes: {', '.join(packaged_recipes())}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument(
            "--config",
            metavar="RECIPE",
            help=f"YAML recipe: a path, or the name of a packaged recipe (default: {default})",
        )
        sub.add_argument(
            "--dry-run",
            action="store_true",
            help="validate the recipe and overrides, print the resolved config and exit",
        )
        sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (see below)")
    return parser


def resolve_recipe(subcommand: Subcommand, config: str | None) -> Path:
    if config is None:
        if subcommand.default_recipe is None:
            raise ConfigError(f"rl {subcommand.name} needs --config (it has no default recipe)")
        return packaged_recipe(subcommand.default_recipe)
    path = Path(config)
    if not path.exists():
        name = config if config.endswith(".yaml") else f"{config}.yaml"
        if name in packaged_recipes():
            return packaged_recipe(name)
    return path


def import_target(target: str) -> Any:
    """The attribute a `module:attribute` string names."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def one_line(error: BaseException) -> str:
    """The error's message; a validation report with a single problem becomes one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) == 2 and lines[1].startswith("- "):
        header = lines[0].rstrip(":")
        if header.endswith("(1 problem)"):
            header = header[: -len("(1 problem)")].rstrip()
        return f"{header}: {lines[1][2:]}"
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    subcommand = SUBCOMMANDS[args.command]
    prefix = f"rl {subcommand.name}: error:"
    # Errors a user can fix in the recipe, overrides or data: exit status 2, no traceback.
    user_errors: tuple[type[BaseException], ...] = (ConfigError,)
    try:
        from rl_core.checkpoint import CheckpointIncompatibleError
        from rl_core.config import load_validated_config

        user_errors = (ConfigError, CheckpointIncompatibleError)
        recipe = resolve_recipe(subcommand, args.config)
        schema = import_target(subcommand.schema)
        cfg = load_validated_config(recipe, schema, args.overrides)
        if args.dry_run:
            import yaml

            print(f"# {recipe}", file=sys.stdout)
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="", file=sys.stdout)
            return 0
        runner: Callable[[Any], Any] = import_target(subcommand.runner)
        runner(cfg)
    except user_errors as error:
        print(f"{prefix} {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"rl {subcommand.name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
