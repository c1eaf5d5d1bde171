"""`./check.sh run --model DIR "prompt"`: your own engine (or model) answering a prompt from a local Qwen3
checkpoint, text in and text out.

    ./check.sh run --model ~/models/Qwen3-0.6B "The capital of France is"
    ./check.sh run --model ~/models/Qwen3-0.6B --chat --no-thinking "Name three prime numbers."
    ./check.sh run --model ~/models/Qwen3-0.6B --prompts prompts.txt --temperature 0.7 --top-p 0.9 --seed 1
    ./check.sh run --model ~/models/Qwen3-0.6B --compare "The capital of France is"

The tokenizer and the weights come from the folder only (nothing is downloaded). Your code runs in a
worker process, as it does for the checks: p06's `LLM` when your p06 passed its checks (`./check.sh
p06`), else m04's `model_forward`, greedy, token by token on the CPU; the first lines say which. With
one prompt the text streams as the tokens arrive; several prompts (`--prompts FILE`, one a line, or
several arguments) run as one batch and print when they finish. The last line gives the prompt and
output token counts, the time to the first token and the output tokens per second. `--compare` runs
Hugging Face's `generate` on the same weights and prompt (greedy) and shows where the two texts part.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / ".kvlab" / "results.json"
ENGINES = {"p06": "p06_engine", "m04": "m04_qwen3_model"}
PAGE = "exercises/m04_qwen3_model.md, \"Run it on a real model\""
# Two runs of one model that differ only in rounding part where the best two logits lie within a few of the
# dtype's steps (in bf16, 28 layers of rounding move a logit by several)
NEAR_TIE_STEPS = 4


class RunError(Exception):
    """A problem with the command's input, said in one line."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="./check.sh run", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("prompt", nargs="*", help="the prompt(s); several run as one batch")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a local Qwen3 checkpoint: config.json, tokenizer.json and *.safetensors")
    parser.add_argument("--prompts", metavar="FILE", help="more prompts, one a line (blank lines skipped)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                        help="with --chat: Qwen3's enable_thinking on or off (default: the template's, on)")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="new tokens per prompt at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (the default) is greedy")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="keep the K most likely tokens, and any tied with the K-th (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="keep the smallest set with this much probability")
    parser.add_argument("--seed", type=int, metavar="N", help="a seed for sampling (the same text every time)")
    parser.add_argument("--impl", default="mine", metavar="IMPL",
                        help="mine (default), solutions, or a folder with mine/'s file names")
    parser.add_argument("--engine", choices=("auto", "p06", "m04"), default="auto",
                        help="p06 (your engine), m04 (your model, greedy) or auto: p06 once it passes its checks")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="the weights' dtype (default: bfloat16 for p06, whose attention kernel takes 16-bit "
                             "floats; float32 for m04)")
    parser.add_argument("--compare", action="store_true",
                        help="also run Hugging Face's generate (greedy) and show where the texts part")
    parser.add_argument("--time-limit", type=float, default=3600.0, metavar="S",
                        help="seconds loading or generating may take")
    parser.add_argument("--memory-limit", type=float, metavar="GIB",
                        help="GiB your code's process may use (default: 80%% of this machine's memory)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.compare and args.temperature > 0:
        parser.error("--compare is greedy: leave --temperature at 0")
    return args


# ---- the checkpoint ------------------------------------------------------------------------------------


def read_config(folder: Path) -> dict:
    """The checkpoint's config.json, after every check that a missing or foreign folder fails (one line each)."""
    if not folder.is_dir():
        raise RunError(f"--model {folder}: no such folder (see {PAGE} for how to get Qwen3-0.6B)")
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise RunError(f"--model {folder}: no {name} there (a Qwen3 checkpoint folder holds config.json, "
                           f"tokenizer.json, tokenizer_config.json and *.safetensors)")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RunError(f"--model {folder}: config.json cannot be read ({error})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind != "qwen3":
        raise RunError(f"--model {folder}: config.json says model_type {kind!r}, not 'qwen3': the kit's model is "
                       "dense Qwen3 (Qwen3-0.6B, 1.7B, 4B)")
    if not config.get("tie_word_embeddings", False):
        raise RunError(f"--model {folder}: this checkpoint has its own lm_head (tie_word_embeddings false, as "
                       "Qwen3-8B and larger); the kit's model ties the LM head to the embedding, as Qwen3-0.6B, "
                       "1.7B and 4B do")
    if not any(folder.glob("*.safetensors")):
        raise RunError(f"--model {folder}: no *.safetensors weights there")
    return config


def load_tokenizer(folder: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder only: never a download
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # HF's "Loading weights" bar would land in the middle of the text

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - a broken tokenizer file: one line, not a traceback
        raise RunError(f"--model {folder}: its tokenizer cannot be loaded ({type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''})") from None


def prompt_ids(tokenizer, text: str, chat: bool, thinking: bool | None) -> list[int]:
    """The prompt's token ids: as written, or inside the chat template exactly as HF renders it."""
    if not chat:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) or \
            list(tokenizer(text)["input_ids"])
    if not tokenizer.chat_template:
        raise RunError("--chat: this tokenizer has no chat template (tokenizer_config.json's chat_template); "
                       "run without --chat")
    options = {} if thinking is None else {"enable_thinking": thinking}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, **options)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def stop_ids(folder: Path, config: dict, tokenizer) -> list[int]:
    """Every token that ends a completion: generation_config.json's eos ids, config.json's, the tokenizer's."""
    found = []
    sources = [config]
    try:
        sources.insert(0, json.loads((folder / "generation_config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        pass
    for source in sources:
        value = source.get("eos_token_id") if isinstance(source, dict) else None
        found += value if isinstance(value, list) else [value]
    found.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(t) for t in found if isinstance(t, int)))


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts:
        try:
            lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise RunError(f"--prompts {args.prompts}: cannot be read ({error})") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise RunError('no prompt: give one (./check.sh run --model DIR "The capital of France is") or --prompts FILE')
    return prompts


# ---- which of the learner's modules serves -------------------------------------------------------------


def choose_engine(args, impl) -> tuple[str, str]:
    """("p06" or "m04", why): p06 once it passed its checks, else m04."""
    if args.engine != "auto":
        return args.engine, "--engine " + args.engine
    if impl.kind == "reference":
        return "p06", "the reference"
    if impl.label != "mine":
        return "m04", "a folder's p06 is served only with --engine p06"
    try:
        entry = json.loads(RESULTS.read_text(encoding="utf-8")).get("p06_engine")
    except (OSError, ValueError, AttributeError):
        entry = None
    if not isinstance(entry, dict) or entry.get("checks", 0) == 0:
        return "m04", "p06 has not been checked yet (./check.sh p06)"
    if entry.get("passed") != entry.get("checks"):
        return "m04", f"p06 passed {entry.get('passed')} of its {entry.get('checks')} checks (./check.sh p06)"
    try:
        checked = time.mktime(time.strptime(str(entry.get("when")), "%Y-%m-%d %H:%M")) + 60  # minutes kept only
    except ValueError:
        checked = 0.0
    if impl.path("p06_engine").stat().st_mtime > checked:
        return "m04", "mine/p06_engine.py changed since it passed its checks (./check.sh p06)"
    return "p06", f"p06 passed its checks ({entry.get('when')})"


# ---- serving -------------------------------------------------------------------------------------------


class Stream:
    """Each prompt's tokens as they arrive; with one prompt, its text printed as it grows."""

    def __init__(self, tokenizer, count: int, stops: list[int], live: bool):
        self.tokenizer, self.stops, self.live = tokenizer, set(stops), live
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.ended = [False] * count  # a stop token arrived: what follows is not shown
        self.shown = ""
        self.started = self.first = self.last = None

    def on_tokens(self, updates) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        for index, new in updates:
            for token in new:
                if not self.ended[index]:
                    self.tokens[index].append(int(token))
                    self.ended[index] = int(token) in self.stops
        if self.live:
            self.show(self.text(0))

    def text(self, index: int, tokens: list[int] | None = None) -> str:
        return self.tokenizer.decode(self.tokens[index] if tokens is None else tokens, skip_special_tokens=True)

    def show(self, text: str, final: bool = False) -> None:
        if text.endswith("\ufffd") and not final:  # half of a character: wait for its other bytes
            return
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
        else:  # a later token changed how the earlier ones decode: start the line again
            sys.stdout.write("\n" + text)
        sys.stdout.flush()
        self.shown = text


def cut_at_stop(tokens: list[int], stops: list[int]) -> list[int]:
    """The completion up to and with its first stop token (an engine stops at one; HF at any)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def serve(args, impl, stem: str, folder: Path, ids: list[list[int]], stops: list[int], device: str, dtype: str,
          stream: Stream) -> list[list[int]]:
    from checks.harness.guard import LearnerError, ModuleRun, NotStarted
    from checks.harness.worker import ForkServer

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory = int(args.memory_limit * 2**30) if args.memory_limit else int(total * 0.8)
    server = ForkServer(triton=stem == "p06_engine", cuda=device == "cuda", memory_limit=memory)
    run = ModuleRun(server, impl, stem, args.time_limit)
    block_size = 16
    longest = max(len(p) for p in ids) + args.max_tokens
    engine_config = {"block_size": block_size, "max_model_len": longest, "eos_token_id": stops[0] if stops else -1,
                     "num_blocks": sum(math.ceil((len(p) + args.max_tokens) / block_size) + 1 for p in ids),
                     "max_num_seqs": min(len(ids), 256), "cuda_graphs": device == "cuda"}
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "max_tokens": args.max_tokens, "ignore_eos": False, "seed": args.seed}
    try:
        started = time.perf_counter()
        threads = len(os.sched_getaffinity(0))
        loaded = run.exchange(("text", "load", str(folder), dtype, device, engine_config, threads),
                              "loading the model")[1]
        count = loaded["parameters"]
        size = f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count / 1e6:.2f} M"
        print(f"loaded {loaded['layers']} layers, {size} parameters in "
              f"{time.perf_counter() - started:.1f} s\n", flush=True)
        stream.started = time.perf_counter()
        outputs = run.exchange(("text", "generate", ids, sampling, stops, stream.on_tokens), "generating")[1]
    except NotStarted as error:
        reason = str(error)
        if ": finish " in reason:  # another of your files is still a stub
            first = reason.rsplit(": finish ", 1)[1].split()[0]
            raise RunError(f"{reason} (./check.sh {first})") from None
        first = stem.split("_")[0]
        raise RunError(f"{reason}: finish {first} first (./check.sh {first})") from None
    except LearnerError as error:
        raise RunError(f"your code: {error}") from None
    finally:
        run.close()
        server.stop()
    if not isinstance(outputs, list) or len(outputs) != len(ids) or \
            not all(isinstance(o, list) and all(type(t) is int for t in o) for o in outputs):
        raise RunError(f"your {stem.split('_')[0]} returned {type(outputs).__name__}, not one list of token ids "
                       "per prompt")
    return [cut_at_stop(o, stops) for o in outputs]


def compare(folder: Path, ids: list[int], mine: list[int], stops: list[int], dtype: str, device: str, tokenizer,
            max_tokens: int) -> None:
    """HF's greedy `generate` on the same weights: its text, and where (and by what margin) the two part."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), local_files_only=True).to(device)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=stops or None, pad_token_id=(stops or [0])[0], output_logits=True,
                             return_dict_in_generate=True, top_k=None, top_p=None, temperature=None)
    theirs = cut_at_stop(out.sequences[0, len(ids):].tolist(), stops)
    print("\n── Hugging Face generate (greedy, same weights) ──")
    print(tokenizer.decode(theirs, skip_special_tokens=True))
    part = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if part is None and len(mine) == len(theirs):
        print(f"\nThe same {len(mine)} tokens.")
        return
    if part is None:
        part = min(len(mine), len(theirs))
        print(f"\nThe same first {part} tokens; then one text ends ({len(mine)} tokens yours, {len(theirs)} HF's).")
        return
    logits = out.logits[part][0].float()
    best = torch.topk(logits, 2).values
    margin = float(best[0] - best[1])
    # one step of the dtype at HF's best logit: the spacing of representable values there
    step = 2.0 ** math.floor(math.log2(max(abs(float(best[0])), 1e-30))) * torch.finfo(getattr(torch, dtype)).eps
    print(f"\nThey part at output token {part}: yours {tokenizer.decode([mine[part]])!r} (id {mine[part]}), HF's "
          f"{tokenizer.decode([theirs[part]])!r} (id {theirs[part]}). HF's margin between its two best logits "
          f"there: {margin:.4g} ({margin / step:.3g} steps of {dtype} at {float(best[0]):.4g}); your token's logit is "
          f"{float(best[0] - logits[mine[part]]):.4g} below HF's best."
          + (f" A near-tie: {dtype} rounding decides it." if margin <= NEAR_TIE_STEPS * step else ""))


def main(argv: list[str]) -> int:
    args = parse(argv)
    from checks.harness.loader import NOT_SANDBOXED, LoadError, named

    try:
        impl = named(args.impl)
        if impl.kind == "learner" and not impl.folder.is_relative_to(ROOT / "mine"):
            print(NOT_SANDBOXED.format(impl.shown_folder()), file=sys.stderr)
        folder = Path(args.model).expanduser()
        config = read_config(folder)
        prompts = read_prompts(args)
        engine, why = choose_engine(args, impl)
        import torch

        # m04 is written for the CPU (and needs no Triton); p06 serves on a GPU unless Triton is told to interpret
        if engine == "p06" and not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before a kernel is decorated, in the worker too
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        device = "cuda" if torch.cuda.is_available() and engine == "p06" and not interpreted else "cpu"
        # p03's kernel takes 16-bit floats (tensor cores); m04 runs in float32 on the CPU unless told otherwise
        dtype = args.dtype or ("bfloat16" if engine == "p06" else "float32")
        tokenizer = load_tokenizer(folder)
        ids = [prompt_ids(tokenizer, p, args.chat, args.thinking) for p in prompts]
        if not all(ids):
            raise RunError("a prompt has no tokens: give some text")
        stops = stop_ids(folder, config, tokenizer)
        sampled = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}, top-k {args.top_k}, " \
            f"top-p {args.top_p:g}, seed {args.seed}"
        if engine == "m04":
            serving = f"m04: your model_forward, greedy, token by token on the CPU ({why})"
            if args.temperature > 0:
                serving += "; sampling needs p06, this run is greedy"
        else:
            serving = f"p06: your LLM.generate, {sampled} ({why})"
            if device == "cpu":
                serving += "; on a CPU your kernels run in Triton's interpreter: slow on a real checkpoint " \
                           "(--engine m04 runs your m04 model in plain PyTorch)"
        print(f"{impl.shown_folder()} · {folder} · {dtype} on the {'GPU' if device == 'cuda' else 'CPU'}")
        print(serving, flush=True)
        stream = Stream(tokenizer, len(ids), stops, live=len(ids) == 1)
        outputs = serve(args, impl, ENGINES[engine], folder, ids, stops, device, dtype, stream)
    except (RunError, LoadError) as error:
        print(f"\n./check.sh run: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n./check.sh run: interrupted", file=sys.stderr)
        return 130
    if len(ids) == 1:
        stream.show(stream.text(0, outputs[0]), final=True)
        print()
    else:
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            print(f"── {i + 1}. {prompt}\n{stream.text(i, output)}\n")
    produced = sum(len(o) for o in outputs)
    elapsed = (stream.last or time.perf_counter()) - stream.started
    first = (stream.first - stream.started) if stream.first else elapsed
    print(f"\nprompt {sum(len(p) for p in ids)} tokens · output {produced} tokens · first token after {first:.2f} s · "
          f"{produced} tokens in {elapsed:.2f} s = {produced / max(elapsed, 1e-9):.1f} tokens/s"
          + ("" if stream.first else " (the text arrived at the end: your scheduler's postprocess could not be "
                                    "watched)"))
    if args.compare:
        for i, (prompt_tokens, output) in enumerate(zip(ids, outputs)):
            if len(ids) > 1:
                print(f"\n── {i + 1}. {prompts[i]}")
            compare(folder, prompt_tokens, output, stops, dtype, device, tokenizer, args.max_tokens)
    return 0
