"""The probe's one-pass CPU kernel (docs/probe.md, "Cost"): numba, compiled on first use and cached on disk."""

import numba
import numpy as np


@numba.njit(nogil=True, fastmath={"reassoc", "nsz", "contract", "arcp"}, cache=True)
def site_dots(sites, pos, pairs, norm_of, eps, t0, t1, dots, totals):  # type: ignore[no-untyped-def]
    """For tokens ``t0 <= t < t1`` of the ``[batch, len(pos)]`` grid (position ``pos[p]`` of ``sites``' ``[batch,
    n_pos, d]`` arrays): ``dots[r, b, p]`` = float64 dot product of sites ``pairs[r]``, and for each ``norm_of[j] =
    (site, r)`` with norm ``sqrt(dots[r]) > eps``, the site's unit vector added to ``totals[b, j]``. One read
    of each activation, no float64 copy; the products of float32 numbers are exact in float64."""
    n_pos, d = pos.shape[0], sites[0].shape[2]
    for t in range(t0, t1):
        b, p = t // n_pos, t % n_pos
        q = pos[p]
        for r in range(pairs.shape[0]):
            u, v = sites[pairs[r, 0]][b, q], sites[pairs[r, 1]][b, q]
            s = 0.0
            for i in range(d):
                s += np.float64(u[i]) * np.float64(v[i])
            dots[r, b, p] = s
        for j in range(norm_of.shape[0]):
            n = np.sqrt(max(dots[norm_of[j, 1], b, p], 0.0))
            if n > eps:
                u, inv = sites[norm_of[j, 0]][b, q], 1.0 / n
                for i in range(d):
                    totals[b, j, i] += np.float64(u[i]) * inv
