"""One sparse decode step: its schedule (:mod:`.schedule`, the rules every route follows)."""
