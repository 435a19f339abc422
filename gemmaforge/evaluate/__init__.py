"""`gemmaforge eval`: base vs tuned on loss, generation suites, reference metrics and retention."""
