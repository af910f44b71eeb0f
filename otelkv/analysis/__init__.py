"""Analysis of recorded spans: turn phases, turns from spans, diagnoses, slow/conversation/why."""
