"""The GSM8K validation slice: the last `ROWS` problems of the train split, held out of the training mixtures
(`data_mixtures/gsm8k*.yaml` read `train[:-ROWS]`). lm-eval calls `last_rows` on the task's split."""

ROWS = 500


def last_rows(dataset):
    """The last `ROWS` rows of `dataset` (a `datasets.Dataset`; all of a smaller one), in order."""
    return dataset.select(range(max(0, len(dataset) - ROWS), len(dataset)))
