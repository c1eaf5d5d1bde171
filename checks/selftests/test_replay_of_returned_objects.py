"""A replay (naming a mistake) follows the objects a learner's method returns: `schedule()` returns requests
that the next call, `postprocess(requests, ...)`, takes back, and each is compared as it was when it came
back, not as the latest reply left its handle."""

from checks.harness.guard import Call, New, Remote
from checks.harness.loader import named
from checks.harness.mistakes import _replays_alike, catalogue

P05 = "p05_scheduler"


def handle(class_name: str) -> Remote:
    return Remote(None, 0, 0, class_name, "object")  # as a check holds it; nothing here asks a worker


def attributes(obj) -> dict:
    """What the worker sends with an object's handle: its public instance attributes, and its length."""
    found = {k: (list(v) if isinstance(v, list) else v) for k, v in vars(obj).items() if not k.startswith("_")}
    return {**found, "__len__": len(obj)}


def recorded(max_tokens: int) -> list:
    """The events a check records for add, schedule, postprocess, schedule, run here on the reference."""
    scheduler = named("solutions").load(P05).Scheduler(8, 4, 4, 16, -1)
    scheduler_handle, request_handle = handle("Scheduler"), handle("Request")
    owner = id(scheduler_handle)

    def call(name, args, result, handles):
        request_handle._attributes = attributes(request)  # every reply refreshes the handle
        returned = {id(request_handle): attributes(request)} if handles else {}
        return Call(f"Scheduler.{name}", args, {}, result, {}, None, owner=owner, returned=returned)

    events = [New("Scheduler", scheduler_handle, (8, 4, 4, 16, -1))]
    request = scheduler.add(0, [1, 2, 3], max_tokens)
    events.append(call("add", (0, [1, 2, 3], max_tokens), request_handle, True))
    batch, is_prefill = scheduler.schedule()
    events.append(call("schedule", (), ([request_handle] * len(batch), is_prefill), batch))
    tokens = [5] * len(batch)
    finished = scheduler.postprocess(batch, tokens)
    events.append(call("postprocess", ([request_handle] * len(batch), tokens), [request_handle] * len(finished),
                       finished))
    batch, is_prefill = scheduler.schedule()
    events.append(call("schedule", (), ([request_handle] * len(batch), is_prefill), batch))
    return events


def test_returned_requests_are_passed_back_and_compared_as_they_came_back():
    # postprocess takes the requests schedule returned; the add's result is compared with the request as add
    # left it (3 tokens), not as the handle shows it at the end (4 tokens, running)
    assert _replays_alike(recorded(2), named("solutions").load(P05), "exact", 5.0)


def test_a_mutant_that_differs_on_those_calls_is_not_alike():
    late = catalogue(P05).implementation(catalogue(P05).mistake("max-tokens-off-by-one")).load(P05)
    assert _replays_alike(recorded(2), late, "exact", 5.0)  # max_tokens 2: nothing finishes in these calls
    assert not _replays_alike(recorded(1), late, "exact", 5.0)  # max_tokens 1: postprocess finishes it, the mutant not
