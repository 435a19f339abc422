"""Dataset intake: readers to the canonical messages form, split, and the prepared data files."""
