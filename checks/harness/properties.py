"""Property tests on a learner's objects: random examples drawn by hypothesis, played one after another.

A check gives a strategy and a function that plays one example against the learner's code (raising
`Mismatch` at the first difference); hypothesis draws examples from the case's seed (so a run replays)
and shrinks a failing one to a small one. Only the last example's calls are kept for naming a mistake
(`impl.start_over()`), and an implementation that is not started or hangs stops the search at once.
"""

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.errors import Flaky

from .compare import Mismatch
from .guard import LearnerError, NotStarted
from .loader import ROOT

set_hypothesis_home_dir(ROOT / ".kvlab" / "hypothesis")  # its cache goes with the kit's run state, not the cwd


# Plays hypothesis may spend shrinking once an example failed. Shrinking to the very smallest example took up
# to 450 plays (15 s on a 2-core machine) for one failing implementation; the first 30 cut most of an example
# away (p05's mutants: a failure reported one to three steps later than after 60 plays, or 450). Past them, a
# new candidate counts as passing, so hypothesis reports the smallest failing example it has found. A count,
# not a clock: the example reported for a seed is the same on any machine.
SHRINK_PLAYS = 30


def explore(impl, seed: int, strategy, play, max_examples: int, examples: str, learner: str) -> None:
    """Play up to `max_examples` examples of `strategy` with `play(example)`. `examples` and `learner` name
    them in the message for a learner whose results change between two runs of the same example
    ("operations", "manager")."""
    stopped: list[BaseException] = []  # not started, or hung: no use running more examples
    failed: set[str] = set()  # the examples that failed (repr), played again when hypothesis reports one
    shrinking = [0]  # plays since the first failure

    @settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
              verbosity=Verbosity.quiet, phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(example=strategy)
    def run(example):
        if stopped:
            return
        key = repr(example)
        if failed:
            shrinking[0] += 1
            if shrinking[0] > SHRINK_PLAYS and key not in failed:
                return
        impl.start_over()  # only the last example's calls are replayed to name a mistake
        try:
            play(example)
        except NotStarted as error:
            stopped.append(error)
        except LearnerError as error:
            if "did not return within" in str(error) or "hung in an earlier check" in str(error):
                stopped.append(error)
            else:
                failed.add(key)
                raise
        except BaseException:
            failed.add(key)
            raise

    try:
        run()
    except Flaky:
        raise Mismatch(f"the same {examples} gave different results on two runs: does your {learner} depend on "
                       "anything besides its calls (a set's order, a random choice)?") from None
    if stopped:
        raise stopped[0]
