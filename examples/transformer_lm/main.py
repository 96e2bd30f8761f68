"""Trains a small decoder-only transformer LM with NNX + jaxamp (bf16-mixed by default).

  python examples/transformer_lm/main.py --workdir /tmp/lm
  python examples/transformer_lm/main.py --workdir /tmp/lm --precision fp16-mixed --num_steps 500

Writes metrics.json and loss.png into --workdir.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a clean clone

from examples import utils  # noqa: E402
from examples.transformer_lm import config as config_lib  # noqa: E402
from examples.transformer_lm import train  # noqa: E402


def main(argv=None):
    parser = utils.add_common_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    for name in ("d_model", "num_heads", "num_layers", "seq_len", "vocab_size", "eval_every"):
        parser.add_argument(f"--{name}", type=int)
    args = parser.parse_args(argv)
    config = utils.apply_flags(config_lib.get_config(), args)
    metrics = train.train_and_evaluate(config, args.workdir)
    summary = metrics["summary"]
    print(
        f"precision={metrics['policy']} final_loss={summary['final_loss']:.4f} "
        f"eval_perplexity={summary['eval_perplexity']:.2f} "
        f"skipped_steps={summary['skipped_steps']} -> {args.workdir}/metrics.json, loss.png"
    )


if __name__ == "__main__":
    main()
