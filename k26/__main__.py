"""Command line: `python -m k26 generate|info|bench|profile|serve ...`.

Every argument is checked before any weights load (minutes for a real checkpoint), and what a user can
cause ends in one line, never a traceback: bad input exits 2, Ctrl-C 130, a closed pipe (`| head`) 141.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .cli_args import (
    budget_arg,
    cache_dir_arg,
    context_args,
    dir_arg,
    listen_arg,
    out_arg,
    pair_args,
    resolved_pair,
)
from .cli_parser import AR_WITH_DRAFTER, DEFAULT_MAX_TOKENS, DTYPES, parse_args
from .embedded import default_model_dir

if TYPE_CHECKING:
    from . import SamplingParams, SpecConfig


@dataclass
class GeneratePlan:
    """`generate`'s arguments, checked and resolved before the model loads."""

    model: Path
    drafter: Path | None  # None: autoregressive, no drafter loaded
    sampling: SamplingParams
    spec: SpecConfig  # fitted to the context
    prompt_ids: list[int]
    show_prompt: str  # echoed before the continuation ("" with --chat)
    tp: int


def _resolve_pair(a: argparse.Namespace) -> tuple[Path, Path | None, str]:
    """(model dir, drafter dir or None, method). A drafter means DDTree unless --spec says otherwise: the
    embedded pair's drafter comes with it; --drafter never goes unused, --spec never lacks one."""
    budget_arg(a.budget)
    model, drafter = resolved_pair(a)
    method = a.spec or ("ddtree" if drafter is not None else "ar")
    if method == "ar":
        if a.drafter:
            raise ValueError(AR_WITH_DRAFTER)
        drafter = None
    elif drafter is None:
        raise ValueError(f"--spec {method} needs --drafter DIR (a DFlash drafter trained for this model)")
    if a.budget not in (None, "auto") and method != "ddtree":  # ('auto': the default, said aloud)
        raise ValueError(f"--budget applies to --spec ddtree (this run decodes with {method})")
    return model, drafter, method


def plan_generate(a: argparse.Namespace) -> GeneratePlan:
    """Check every `generate` argument against the config files only: no weights are read."""
    from . import SamplingParams, SpecConfig
    from .chat import ChatFormat, Message, render
    from .checks import check_device, check_gpus, fit_spec
    from .config import ModelConfig
    from .dist import env_int
    from .drafter_config import DrafterConfig
    from .sampling import SamplingError
    from .tokenizer import Tokenizer

    check_device(a.device)
    cache_dir_arg(a.cache_dir)
    model, drafter, method = _resolve_pair(a)
    try:
        sp = SamplingParams(
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            max_tokens=DEFAULT_MAX_TOKENS if a.max_tokens is None else a.max_tokens,
            seed=a.seed,
            presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty,
            stop_token_ids=() if a.ignore_eos else None,
        )
    except SamplingError as e:  # named by its flag (every field set here is one: --top-p for top_p)
        raise ValueError(f"--{e.field.replace('_', '-')} {e.value}: {e.why}") from None
    spec = SpecConfig(method=method, budget=a.budget if a.budget is not None else "auto")
    world = env_int("WORLD_SIZE", 1)  # torchrun --nproc-per-node N: one rank per process
    tp = a.tp or world
    if tp < 1:
        raise ValueError(f"--tp {tp}: expected a positive number of ranks")
    if "WORLD_SIZE" in os.environ and tp != world:  # (WORLD_SIZE 1 with --tp 2 included)
        raise ValueError(f"--tp {tp} differs from torchrun's WORLD_SIZE {world}")
    check_gpus(a.device, tp)
    cfg = ModelConfig.from_dir(model)
    max_len = context_args(cfg, tp, a.max_model_len, a.allreduce, "--tp" if a.tp else "torchrun's WORLD_SIZE")
    tok = Tokenizer.from_dir(model)
    fmt = ChatFormat.of_checkpoint(model, cfg.model_type)
    if a.no_thinking and (not a.chat or fmt.thinking is None):
        raise ValueError("--no-thinking applies to --chat on a K2.5 / K2.6 model (its think block)")
    fmt = fmt.with_thinking(False if a.no_thinking else None)
    try:  # (bytes that are not UTF-8 reach argv as lone surrogates)
        ids = render(tok, [Message("user", a.prompt)], fmt) if a.chat else tok.encode(a.prompt)
    except ValueError as e:
        raise ValueError(f"--prompt: {e} (not valid UTF-8?)") from None
    if not a.prompt or not ids:  # (--chat wraps even an empty one in its turns)
        raise ValueError("--prompt is empty")
    if len(ids) >= max_len:
        raise ValueError(
            f"--prompt has {len(ids)} tokens; the context holds {max_len} (--max-model-len), "
            "leaving no room to generate"
        )
    room = max_len - len(ids)
    if a.max_tokens is not None and a.max_tokens > room:  # (as the server's 400: no completion silently cut)
        raise ValueError(
            f"--max-tokens {a.max_tokens}: the prompt's {len(ids)} tokens leave room for {room} in the "
            f"context of {max_len} (--max-model-len)"
        )
    if a.max_tokens is None and room < sp.max_tokens:  # the default: as many as the context leaves
        sp = dataclasses.replace(sp, max_tokens=room)
    if drafter is not None:  # last: a warning about the context only once nothing else is wrong
        dcfg = DrafterConfig.from_dir(drafter)
        dcfg.check_target(cfg)
        spec = fit_spec(spec, max_len, dcfg.block_size)
    return GeneratePlan(model, drafter, sp, spec, ids, "" if a.chat else a.prompt, tp)


def cmd_generate(a: argparse.Namespace) -> int:
    """Echo the prompt, then stream the continuation as it is accepted; stats go to stderr."""
    plan = plan_generate(a)
    import torch

    from . import LLM
    from .dist import rank_and_world

    # (RANK / WORLD_SIZE checked here too: a stale RANK=1 left every line unprinted, exit 0)
    rank0 = rank_and_world()[0] == 0
    llm = LLM(
        plan.model,
        drafter=plan.drafter,
        device=a.device,
        dtype=getattr(torch, DTYPES[a.dtype]),
        max_model_len=a.max_model_len,
        max_batch=1,  # one prompt: the default 8 rows of KV cache would only take memory
        tp=plan.tp,
        progress=rank0,
        cache_dir=a.cache_dir,
        allreduce=a.allreduce or "fused",
    )
    out = None
    try:
        if rank0:
            print(plan.show_prompt, end="", flush=True)
        pieces = llm.stream(plan.prompt_ids, plan.sampling, plan.spec)
        while True:
            try:
                piece = next(pieces)
            except StopIteration as done:
                out = done.value
                break
            if rank0:
                print(piece, end="", flush=True)
    except BaseException:
        # (a closed pipe, Ctrl-C) closed before `pieces` is dropped: under TP the suspended stream, collected,
        # would otherwise run the mirrored stream to --max-tokens to keep the ranks in step
        llm.close()
        raise
    finally:
        if rank0:
            print(flush=True)  # end the line, also when interrupted
    llm.close()
    if rank0 and out is not None:
        extra = ""
        if plan.spec.method != "ar":
            st = out.stats
            extra = f", {len(st.accepted_per_step)} verify steps, tau={st.tau:.2f}"
            if st.draft_s or st.verify_s:  # eager only: a graph step has no phase bounds
                extra += f", draft {st.draft_s * 1e3:.1f} ms, verify {st.verify_s * 1e3:.1f} ms"
        n, why = len(out.token_ids), out.finish_reason
        print(f"[k26] {n} tokens, {plan.spec.method}, finish_reason={why}{extra}", file=sys.stderr)
    return 0


ONE_PROCESS = " (--tp is generate's and serve's)"  # bench / profile / info --startup under torchrun


def _tokens_arg(a: argparse.Namespace, prompt_tokens: int) -> None:
    """--max-tokens against the room a bench / profile prompt of `prompt_tokens` leaves in the model's default
    context: beyond it the rows stop at the context, and a report would claim tokens never generated."""
    from .checks import default_max_model_len
    from .config import ModelConfig

    max_len = default_max_model_len(ModelConfig.from_dir(dir_arg(a.model, "--model") or default_model_dir()))
    if prompt_tokens >= max_len:  # (it said "leave room for -12")
        raise ValueError(
            f"the {prompt_tokens}-token prompts of this command do not fit the model's context of {max_len}"
        )
    if a.max_tokens > max_len - prompt_tokens:
        raise ValueError(
            f"--max-tokens {a.max_tokens}: its {prompt_tokens}-token prompts leave room for "
            f"{max_len - prompt_tokens} in the model's context of {max_len}"
        )


def cmd_info(a: argparse.Namespace) -> int:
    from .config import ModelConfig
    from .kv_cache import LatentCache

    for flag, value in (("--drafter", a.drafter), ("--cache-dir", a.cache_dir), ("--device", a.device)):
        if value is not None and not a.startup:  # (they only matter to the start-up it runs)
            raise ValueError(f"{flag} goes with --startup")
    if a.startup:  # its arguments checked before anything is printed
        from .checks import check_device
        from .dist import one_process

        one_process("info --startup", ONE_PROCESS)
        check_device(a.device)
        cache_dir_arg(a.cache_dir)
        import torch

        from .checks import check_pair

        model, drafter = resolved_pair(a)
        # the pair's files (configs, tokenizer, the drafter's) as LLM checks them, before anything is printed
        check_pair(model, drafter, 1, torch.bfloat16, None, 8, None)
    cfg = ModelConfig.from_dir(dir_arg(a.model, "--model") or default_model_dir())
    for k, v in vars(cfg).items():
        print(f"{k:28s} {v}")
    print(f"{'softmax_scale':28s} {cfg.softmax_scale:.7f}")
    print(f"{'kv bytes/token (bf16)':28s} {LatentCache.bytes_per_token(cfg)}")
    if a.startup:  # start it: what the load read, the repack and each captured graph cost
        from .engine import LLM

        drafter = dir_arg(a.drafter, "--drafter")
        llm = LLM(a.model, drafter=drafter, device=a.device, capture=True, cache_dir=a.cache_dir)
        print("start-up:", *llm.startup.lines(), sep="\n")
        llm.close()
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import PROMPT_TOKENS, run_bench
    from .checks import check_device
    from .dist import one_process

    one_process("bench", ONE_PROCESS)
    pair_args(a)
    out_arg(a.out, "--out")
    check_device(a.device)
    _tokens_arg(a, PROMPT_TOKENS)
    text = run_bench(a)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .bench import PROFILE_PROMPT, run_profile
    from .checks import check_device
    from .dist import one_process

    one_process("profile", ONE_PROCESS)
    pair_args(a)
    if a.drafter and a.spec == "ar":  # (as generate and serve: a drafter that would go unused, and unchecked)
        raise ValueError(AR_WITH_DRAFTER)
    out_arg(a.out, "--out")
    check_device(a.device)
    _tokens_arg(a, len(PROFILE_PROMPT))
    print(run_profile(a))
    print(f"[k26] torch.profiler trace written to {a.out}", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from .checks import check_device
    from .server.cli import check_args, serve

    pair_args(a)
    cache_dir_arg(a.cache_dir)
    check_device(a.device)
    check_args(a)
    return serve(a, listen_arg(a.host, a.port))


COMMANDS = {
    "generate": cmd_generate,
    "info": cmd_info,
    "bench": cmd_bench,
    "profile": cmd_profile,
    "serve": cmd_serve,
}


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"k26: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning  # restored on exit: main() also runs in-process (tests)
        try:
            return COMMANDS[a.cmd](a)
        except (ValueError, TypeError) as e:  # ConfigError, CheckpointError, ShardChangedError, bad arguments
            print(f"k26: error: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            from .dist import group_failure
            from .graphs.runner import CaptureError  # (here, not at the top: `--help` stays free of torch)
            from .tp_driver import RankError

            said = group_failure(e)  # under torchrun: a peer that never joined, or left
            if not isinstance(e, (RankError, CaptureError)) and said is None:
                raise
            # a TP rank crashed (users' errors come as themselves), or a graph did not fit: its remedy is said
            print(f"k26: error: {said or e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("k26: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `python -m k26 info | head`: the reader left; nothing more to say
            with contextlib.suppress(OSError, ValueError):  # no fd when stdout is captured in-process
                os.dup2(
                    os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
                )  # the exit flush must not raise
            return 141


if __name__ == "__main__":
    sys.exit(main())
