"""Small shared helpers below every room: lazy package attributes (:mod:`.lazy`), progress callbacks
(:mod:`.progress`) and the one timer (:mod:`.timing`)."""
