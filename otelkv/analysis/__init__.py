"""Analysis of recorded spans: turn reconstruction (and, later, diagnoses and what-if)."""
