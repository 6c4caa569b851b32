"""Small shared helpers below every room: lazy package attributes (:mod:`.lazy`), progress callbacks
(:mod:`.progress`), the one timer (:mod:`.timing`), thread caps (:mod:`.threads`), and the package version."""

__version__ = "0.1.0"

