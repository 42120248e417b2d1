"""A request's queue split as its encoders report it: the longest queue counts, with its own preprocessing."""

from __future__ import annotations

import math

from encdis.llm_node.coordinator.records import RequestTiming


def test_the_longest_queue_counts_with_the_preprocessing_of_that_same_image() -> None:
    t = RequestTiming()
    t.observe_queue(0.2, 0.05)
    t.observe_queue(0.5, 0.1)
    t.observe_queue(0.3, 0.25)  # more preprocessing, shorter queue: not the image waited for longest
    assert (t.queue, t.preprocess) == (0.5, 0.1)


def test_an_encoders_preprocessing_is_kept_within_its_queue_and_never_negative() -> None:
    over, negative, nan = RequestTiming(), RequestTiming(), RequestTiming()
    over.observe_queue(0.2, 7.0)
    negative.observe_queue(0.2, -1.0)
    nan.observe_queue(0.2, math.nan)
    assert over.preprocess == 0.2 and negative.preprocess == 0.0 and nan.preprocess == 0.0
    ignored = RequestTiming()
    ignored.observe_queue(math.nan, 0.1)  # a queue that is not a number is not the longest
    assert (ignored.queue, ignored.preprocess) == (0.0, 0.0)
