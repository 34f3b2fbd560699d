"""A user's off-policy corrections, each one function in this one file (``tests/test_train_corrections.py``
names them by import path: ``offpolicy.correction: correction_fixture:truncated``)."""

from neon_hpc.train.corrections import correction


@correction("fixture_truncated", metrics=("fixture_weight_mean", "fixture_over_frac"))
def truncated(ratio, limit: float = 2.0):
    """The same weights as the built-in ``tis`` (``min(ratio, limit)``), under other metric names."""
    w = ratio.clamp(max=limit)
    return w, {"fixture_weight_mean": w, "fixture_over_frac": (ratio > limit).to(ratio.dtype)}


@correction("fixture_wrong_metrics", metrics=("declared",))
def wrong_metrics(ratio):
    """Returns a metric it did not declare: the start-up check refuses it."""
    return ratio, {"undeclared": ratio}


def not_registered(ratio):
    return ratio, {}
