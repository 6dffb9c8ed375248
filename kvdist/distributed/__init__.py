"""Multi-rank machinery: the library's communicator, deadline-bounded collectives,
and the start-up consensus."""
