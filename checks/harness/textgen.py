"""The worker's side of `./check.sh run`: a local checkpoint loaded and served by the learner's own code.

Shipped to the worker as text (imports only the standard library and torch), like `serve.py`. The kit
sends two requests: `load` builds the model with the learner's m04 `load_pretrained` and, for p06, the
learner's `LLM` over it; `generate` serves the prompts and sends each new token back to the kit as it
arrives, through a call-back (`on_tokens([(prompt index, [tokens...]), ...])`), before it returns every
prompt's completion. Which learner function is running is kept in `RUNNING`, so an exception or a
stub names it.

- p06: `LLM(model, EngineConfig(...)).generate(prompts, SamplingParams(...))`. Tokens are seen as they
  arrive by wrapping the instance's `scheduler.postprocess` (p05's contract: it appends each step's
  tokens to the requests): after every call, what each request gained goes to the kit. An engine whose
  scheduler cannot be wrapped still serves; its text arrives when `generate` returns.
- m04: `model_forward` over one `KVCache` per layer, greedy, one prompt after another: the prompt in one
  call, then one call per new token (what `generate_greedy` does), stopping at a stop token.
"""

import torch

RUNNING = ["loading the model"]  # the learner function running now (for a one-line reason)
LOADED: dict = {}  # what `load` built: engine / model, the module, the device


def learner(name: str):
    RUNNING[0] = name


def parameters(model) -> int:
    """The model's parameter count (the embedding once: the LM head is tied)."""
    count = model.embed_tokens.numel() + model.norm.numel()
    for layer in model.layers:
        count += sum(t.numel() for t in vars(layer).values() if isinstance(t, torch.Tensor))
    return count


def load(package, stem: str, folder: str, dtype: str, device: str, engine_config: dict, threads: int) -> dict:
    torch_dtype, torch_device = getattr(torch, dtype), torch.device(device)
    torch.set_num_threads(threads)  # the checks' tiny tensors run on one; a real model wants every core
    model_module = package.load("m04_qwen3_model")
    learner("load_pretrained")
    model = model_module.load_pretrained(folder, torch_dtype)
    if stem == "p06_engine":
        module = package.load(stem)
        learner("move_weights")
        module.move_weights(model, torch_device)
        config = module.EngineConfig(**engine_config)
        learner("LLM")
        LOADED.update(engine=module.LLM(model, config), module=module)
    else:
        LOADED.update(model=model, module=model_module)
    LOADED["device"] = torch_device
    learner("counting the parameters")
    return {"parameters": parameters(model), "layers": len(model.layers)}


def generate(prompts: list, sampling: dict, stops: list, on_tokens) -> list:
    if "engine" in LOADED:
        return generate_p06(prompts, sampling, on_tokens)
    return generate_m04(prompts, sampling["max_tokens"], set(stops), on_tokens)


def generate_p06(prompts: list, sampling: dict, on_tokens) -> list:
    engine, module = LOADED["engine"], LOADED["module"]
    learner("SamplingParams")
    params = module.SamplingParams(**sampling)
    undo = stream(engine, prompts, on_tokens)
    try:
        learner("LLM.generate")
        outputs = engine.generate(prompts, params)
    finally:
        undo()
    learner("LLM.generate")
    return [[int(t) for t in output] for output in outputs]


def stream(engine, prompts: list, on_tokens):
    """Wrap `engine.scheduler.postprocess` so every step's new tokens reach the kit; returns the undo."""
    try:
        scheduler = engine.scheduler
        original = scheduler.postprocess
    except Exception:  # noqa: BLE001 - no scheduler to watch: the text arrives with the return
        return lambda: None
    which: dict = {}  # request id -> prompt index (each request matched once, by its prompt)
    sent: dict = {}  # prompt index -> tokens already sent
    free = list(range(len(prompts)))

    def postprocess(requests, tokens):
        finished = original(requests, tokens)
        updates = []
        try:
            for request in requests:
                key = request.request_id
                if key not in which:
                    prompt = list(request.token_ids[: request.num_prompt_tokens])
                    match = next((i for i in free if list(prompts[i]) == prompt), None)
                    if match is None:
                        continue
                    free.remove(match)
                    which[key] = match
                index = which[key]
                done = list(request.completion_token_ids)
                if len(done) > sent.get(index, 0):
                    updates.append((index, [int(t) for t in done[sent.get(index, 0):]]))
                    sent[index] = len(done)
        except Exception:  # noqa: BLE001 - a request without p05's attributes: no live text, same result
            updates = []
        if updates:
            on_tokens(updates)
        return finished

    try:
        scheduler.postprocess = postprocess
    except Exception:  # noqa: BLE001 - slots or a property: serve without live text
        return lambda: None

    def undo():
        try:
            del scheduler.postprocess
        except Exception:  # noqa: BLE001
            pass

    return undo


def generate_m04(prompts: list, max_tokens: int, stops: set, on_tokens) -> list:
    model, module, device = LOADED["model"], LOADED["module"], LOADED["device"]
    outputs = []
    for index, prompt in enumerate(prompts):
        learner("KVCache")
        caches = [module.KVCache() for _ in model.layers]  # one per layer
        learner("model_forward")
        logits = module.model_forward(model, torch.tensor(prompt, dtype=torch.int64, device=device), caches)  # [1, V]
        output: list[int] = []
        while True:
            token = int(logits[-1].argmax())
            output.append(token)
            on_tokens([(index, [token])])
            if token in stops or len(output) == max_tokens:
                break
            logits = module.model_forward(model, torch.tensor([token], device=device), caches)  # [1, V]
        outputs.append(output)
    return outputs
