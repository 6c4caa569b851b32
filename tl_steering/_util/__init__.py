"""Small shared helpers below every room: lazy package attributes (:mod:`.lazy`), progress callbacks
(:mod:`.progress`), the one timer (:mod:`.timing`), thread caps (:mod:`.threads`), the parts of a parallel
plan's fitted correction (:mod:`.plan_parts`: the hook factories and the plans both check them), and the package
version."""

__version__ = "0.1.0"

