"""Abstract test suites: every implementation of an interface subclasses one
and supplies only how to build itself, so a new coordinator or source is
proven by the same tests as the others."""
