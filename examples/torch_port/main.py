"""Ports a torch model to Flax, checks the port side by side, trains both under one precision.

  python examples/torch_port/main.py --workdir /tmp/port --precision bf16-mixed
  python examples/torch_port/main.py --workdir /tmp/port --precision fp16-mixed --num_steps 50

Writes metrics.json (both loss curves, forward-pass differences, verdicts) and loss.png.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a clean clone

from examples import utils  # noqa: E402
from examples.torch_port import config as config_lib  # noqa: E402
from examples.torch_port import train  # noqa: E402


def main(argv=None):
    parser = utils.add_common_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--image_size", type=int)
    parser.add_argument("--hidden", type=int)
    args = parser.parse_args(argv)
    config = utils.apply_flags(config_lib.get_config(), args)
    metrics = train.train_and_evaluate(config, args.workdir)
    check, summary = metrics["forward_check"], metrics["summary"]
    print(
        f"port fp32 max|diff|={check['fp32_max_abs_diff']:.2e} ({check['fp32_verdict']}); "
        f"{metrics['precision']} max|diff|={check['policy_max_abs_diff']:.2e} "
        f"({check['policy_verdict']}); final loss jax={summary['final_loss_jax']:.4f} "
        f"torch={summary['final_loss_torch']:.4f}; skipped jax={summary['skipped_steps_jax']} "
        f"torch={summary['skipped_steps_torch']} -> {args.workdir}/metrics.json, loss.png"
    )


if __name__ == "__main__":
    main()
