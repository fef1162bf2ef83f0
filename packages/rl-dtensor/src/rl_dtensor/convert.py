"""Convert a DTensor policy checkpoint (torch.distributed.checkpoint) to a Hugging Face directory.

    python -m rl_dtensor.convert --checkpoint CKPT/policy/weights --out OUT_DIR [--tokenizer DIR]

Runs in one process on CPU whatever the number of ranks that wrote the checkpoint. The model
config is read from the `config.json` the worker saves next to the shards; the tokenizer from
`--tokenizer`, else from a `tokenizer/` directory beside the weights (DESIGN.md §6 layout).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM

from rl_dtensor.checkpoint import HF_CONFIG_FILE, MODEL_KEY, require_checkpoint_dir
from rl_dtensor.model_loading import load_tokenizer
from rl_dtensor.weights import save_hf_directory


def convert_checkpoint_to_hf(
    weights_path: str | Path, out_dir: str | Path, tokenizer_path: str | Path | None = None
) -> Path:
    """Write the checkpoint at `weights_path` as a Hugging Face model directory `out_dir`."""
    weights_dir = Path(weights_path)
    require_checkpoint_dir(weights_dir, "model")
    if not (weights_dir / HF_CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"{weights_dir / HF_CONFIG_FILE} not found: the checkpoint lacks the model config the worker saves with it"
        )
    config = AutoConfig.from_pretrained(str(weights_dir))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    state = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in skeleton.state_dict().items()}
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when no process group exists: that is the intent.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(weights_dir), no_dist=True)
    if tokenizer_path is None and (weights_dir.parent / "tokenizer").is_dir():
        tokenizer_path = weights_dir.parent / "tokenizer"
    tokenizer = load_tokenizer(str(tokenizer_path)) if tokenizer_path is not None else None
    return save_hf_directory(config, state, out_dir, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rl_dtensor.convert", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--checkpoint", required=True, help="the policy's weights checkpoint directory")
    parser.add_argument("--out", required=True, help="where to write the Hugging Face directory")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: ../tokenizer)")
    args = parser.parse_args(argv)
    try:
        out = convert_checkpoint_to_hf(args.checkpoint, args.out, args.tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
