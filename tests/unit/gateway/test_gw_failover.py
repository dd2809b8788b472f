"""The failover core: replay, resume, retry and giving up, without a bus."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spillway.services.gateway.failover import (
    NO_SCHEDULER,
    Failover,
    GiveUp,
    Place,
    Retry,
    State,
    in_order,
)
from spillway.shared.protocol import RequestDelta, SampledLogprobs


def running_on(scheduler: str, sent: int = 0, timeout_s: float = 30.0) -> Failover:
    fo = Failover(timeout_s=timeout_s)
    fo.accepted(scheduler)
    fo.tokens(sent)
    return fo


def test_nothing_sent_replays_from_scratch_elsewhere():
    fo = running_on("a")
    assert fo.lost("a", now=1.0) == Place(frozenset({"a"}), 0)
    assert fo.state is State.PLACING


def test_tokens_sent_resume_after_them():
    fo = running_on("a", sent=7)
    fo.tokens(3)
    assert fo.lost("a", now=1.0) == Place(frozenset({"a"}), 10)
    fo.accepted("b")
    assert fo.state is State.RUNNING and fo.scheduler == "b" and fo.exclude == set()
    fo.tokens(2)
    assert fo.lost("b", now=2.0) == Place(frozenset({"b"}), 12)


def test_another_schedulers_loss_changes_nothing():
    fo = running_on("a", sent=4)
    assert fo.lost("b", now=1.0) is None
    assert fo.state is State.RUNNING and fo.num_sent == 4


def test_bus_back_places_again_without_excluding_the_live_scheduler():
    fo = running_on("a", sent=5)
    assert fo.bus_back("a", now=1.0) == Place(frozenset(), 5)
    assert fo.bus_back("a", now=1.1) is None  # already placing


def test_refusals_retry_until_the_timeout_then_give_up():
    fo = running_on("a", sent=2, timeout_s=1.0)
    assert isinstance(fo.lost("a", now=10.0), Place)
    retry = fo.refused(now=10.1, retryable=True)
    assert retry == Retry(10.1 + fo.retry_s)
    assert fo.tick(now=10.5) == Place(frozenset({"a"}), 2)
    assert fo.refused(now=11.0, retryable=True) == GiveUp(NO_SCHEDULER)
    assert fo.ended
    assert fo.tick(now=12.0) is None and fo.lost("a", now=12.0) is None


def test_a_refusal_that_is_not_retryable_gives_up_with_its_error():
    fo = running_on("a")
    fo.lost("a", now=0.0)
    error = NO_SCHEDULER.model_copy(update={"status": 400, "code": "bad"})
    assert fo.refused(now=0.1, retryable=False, error=error) == GiveUp(error)


def test_a_scheduler_lost_while_placing_is_excluded_from_the_retries():
    fo = running_on("a")
    fo.lost("a", now=0.0)
    fo.lost("b", now=0.1)
    assert fo.tick(now=0.2) == Place(frozenset({"a", "b"}), 0)


def test_a_finished_choice_ignores_everything():
    fo = running_on("a", sent=3)
    fo.finished()
    assert fo.lost("a", now=0.0) is None and fo.bus_back("a", now=0.0) is None
    assert fo.refused(now=0.0, retryable=True) is None


# --- every choice ends exactly once -------------------------------------------------------

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("tokens"), st.integers(0, 5)),
        st.tuples(st.just("lost"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("bus_back"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("accepted"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("refused"), st.booleans()),
        st.tuples(st.just("wait"), st.floats(0.0, 5.0)),
        st.tuples(st.just("finished"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_every_choice_ends_exactly_once_and_resumes_from_what_was_sent(events):
    """A driver that runs the decisions as the request run does; whatever happens, the
    choice ends once (its own end or a give-up), a placement always resumes after the
    tokens the client has, and once nothing answers it gives up within the timeout."""
    fo = Failover(timeout_s=3.0)
    fo.accepted("a")
    now, sent, ends = 0.0, 0, 0
    for kind, arg in events:
        decision = None
        if kind == "tokens":
            if fo.state is State.RUNNING and not fo.ended:
                sent += arg
            fo.tokens(arg)
        elif kind == "lost":
            decision = fo.lost(arg, now)
        elif kind == "bus_back":
            decision = fo.bus_back(arg, now)
        elif kind == "accepted":
            fo.accepted(arg)
        elif kind == "refused":
            decision = fo.refused(now, retryable=arg)
        elif kind == "wait":
            now += arg
            decision = fo.tick(now)
        elif kind == "finished":
            if not fo.ended:
                ends += 1
            fo.finished()
        if isinstance(decision, Place):
            assert decision.resume_from == sent
        if isinstance(decision, GiveUp):
            ends += 1
        assert ends <= 1
        assert fo.ended == (ends == 1)
    # Nothing answers from here on: a choice still placing gives up within the timeout.
    for _ in range(100):
        if fo.ended or fo.state is State.RUNNING:
            break
        decision = fo.refused(now, retryable=True)
        if isinstance(decision, Retry):
            now = decision.at
            decision = fo.tick(now)
        if isinstance(decision, GiveUp):
            ends += 1
    assert fo.state is State.RUNNING or ends == 1


def test_news_after_a_gap_is_refused_and_the_choice_runs_again_from_what_was_sent():
    fo = running_on("a", sent=5)
    late = RequestDelta(request_id="r", token_ids=[8, 9], first_token=7)
    assert not in_order(late, 5)  # tokens 5 and 6 never came
    assert fo.news_lost(now=1.0) == Place(frozenset(), 5)
    assert fo.news_lost(now=1.1) is None  # already placing


def test_news_sent_twice_is_cut_to_what_the_client_lacks():
    lp = [SampledLogprobs(token_id=i, logprob=-float(i)) for i in range(4)]
    again = RequestDelta(request_id="r", token_ids=[5, 6, 7, 8], logprobs=lp, first_token=5)
    assert in_order(again, 7)
    assert again.token_ids == [7, 8] and again.logprobs == lp[2:] and again.first_token == 7
    old = RequestDelta(request_id="r", token_ids=[5], first_token=5)
    assert in_order(old, 7) and old.token_ids == []
    uncounted = RequestDelta(request_id="r", token_ids=[1, 2])
    assert in_order(uncounted, 9) and uncounted.token_ids == [1, 2]
