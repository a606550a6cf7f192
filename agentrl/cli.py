"""`agentrl train | sft | eval | export | bootstrap-tiny | plot`.

The config is parsed before heavy libraries are imported, so `--help` and `--print-config` are
instant and config mistakes are reported before any actor starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from agentrl.config import ConfigError, load_config
from agentrl.driver.watchdog import RunStopped

__all__ = ["main"]


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. replay.max_staleness=0")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="async RL training from a config")
    _config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar: step, reward, tokens/s, staleness, "
                   "ETA, one per step at most every 5 s (the default when output is not a terminal)")

    p = sub.add_parser("sft", help="supervised warm start on an env's expert demonstrations")
    _config_args(p)

    p = sub.add_parser("eval", help="evaluate a model on held-out seeds of an env")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--env", default="agentrl/Calculator-v0", help="registered env id")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--seed-offset", type=int, default=1_000_000)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-parser", default="auto",
                   help="vLLM tool parser of the model's calls (default auto: the checkpoint's family)")

    p = sub.add_parser("export", help="write a run's trained policy as one Hugging Face model (LoRA: merged)")
    p.add_argument("run_dir", help="run directory of a learner.lora run (its config.json names the checkpoints)")
    p.add_argument("--merge-lora", required=True, metavar="OUT", help="directory of the merged model")
    p.add_argument("--checkpoint", default=None, help="checkpoint name, e.g. step_000050 (default: the latest)")
    p.add_argument("--base", default=None, help="base model directory (default: the one the adapter records)")

    p = sub.add_parser("bootstrap-tiny", help="write a tiny random model of a family, with tokenizer and chat template")
    p.add_argument("dir")
    p.add_argument("--family", choices=["qwen2", "qwen3", "qwen3_moe", "llama3", "mistral"], default="qwen2",
                   help="architecture, special tokens and chat-template format (default: qwen2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-length", type=int, default=4096, help="max_position_embeddings")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--induction-steps", type=int, default=0,
                   help="steps of a pre-stage on repeated random token blocks that gives the model induction heads")

    p = sub.add_parser("plot", help="write PNG plots of a run directory")
    p.add_argument("run_dir")
    return parser


def _load(args: argparse.Namespace):
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        sys.exit(0)
    return cfg


def _print_summary(summary: dict, run_dir: str) -> None:
    """Held-out eval before/after and the last step's numbers; everything is in summary.json."""
    rows = [("success", "success"), ("reward", "reward"), ("tool_use_rate", "episodes calling a tool"),
            ("turns", "turns per episode")]
    if any(k.startswith("eval_before/") for k in summary):
        print(f"\nheld-out evaluation ({'greedy'})       before RL    after RL")
        for key, label in rows:
            b, a = summary.get(f"eval_before/{key}"), summary.get(f"eval_after/{key}")
            if b is not None and a is not None:
                print(f"  {label:30s}{b:10.3f}{a:12.3f}")
    last = {k[len("final/"):]: v for k, v in summary.items() if k.startswith("final/")}
    if last:
        print(f"trained {int(last.get('train/version', 0))} learner steps in {last.get('timing/elapsed', 0):.0f} s; "
              f"last batch reward {last.get('rollout/reward', 0):.3f}, max staleness {last.get('replay/staleness_max', 0):.0f}")
    print(f"run directory: {run_dir} (metrics.jsonl, summary.json, tensorboard/, checkpoints/; `agentrl plot {run_dir}`)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; dotted overrides may also come after the options
    (``agentrl train CFG --no-progress seed=1``), which argparse alone refuses."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        if hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
            args.overrides = [*args.overrides, *rest]
        else:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.command == "train":
            cfg = _load(args)
            from agentrl.driver.pipeline import train

            summary = train(cfg, resume=args.resume, progress=not args.no_progress)
            _print_summary(summary, cfg.run_dir)
        elif args.command == "sft":
            cfg = _load(args)
            from agentrl.driver.sft import run_sft

            print(run_sft(cfg))
        elif args.command == "eval":
            from agentrl.driver.evaluate import evaluate_model

            metrics = evaluate_model(
                args.model, args.env, num_episodes=args.episodes, seed_offset=args.seed_offset,
                temperature=args.temperature, max_turns=args.max_turns, tool_parser=args.tool_parser,
            )
            for key, value in metrics.items():
                print(f"{key:28s} {value:.4f}")
        elif args.command == "export":
            from agentrl.learner.lora import merge_run

            print(merge_run(args.run_dir, args.merge_lora, checkpoint=args.checkpoint, base=args.base))
        elif args.command == "bootstrap-tiny":
            from agentrl.model.tiny import bootstrap_tiny

            print(bootstrap_tiny(args.dir, seed=args.seed, family=args.family, max_position_embeddings=args.context_length,
                                 rope_theta=args.rope_theta, induction_steps=args.induction_steps))
        elif args.command == "plot":
            from agentrl.plot import plot_run

            for path in plot_run(args.run_dir):
                print(path)
    except ConfigError as err:
        print(f"agentrl: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # a fault the run could not recover from: the message says which
        print(f"agentrl: {err}", file=sys.stderr)
        return 3
    except FileNotFoundError as err:
        print(f"agentrl: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
