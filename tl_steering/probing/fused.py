"""The probe's one-pass CPU kernel (docs/probe.md, "Cost"): numba, compiled on first use and cached on disk."""

import numba
import numpy as np


@numba.njit(nogil=True, fastmath={"reassoc", "nsz", "contract", "arcp"}, cache=True)
def site_dots(sites, pos, groups, rows, norm_of, eps, t0, t1, dots, totals, counts):  # type: ignore[no-untyped-def]
    """For tokens ``t0 <= t < t1`` of the ``[batch, len(pos)]`` grid (position ``pos[p]`` of ``sites``' ``[batch,
    n_pos, d]`` arrays): the float64 dot products of each group of 3 sites ``groups[g]`` (a smaller one repeats its
    first), pairs c = (0,0) (0,1) (0,2) (1,1) (1,2) (2,2) in one loop over the coordinates, into ``dots[rows[g, c], b,
    p]`` where that row is >= 0; for each ``norm_of[j] = (site, row)`` with ``sqrt(dots[row]) > eps``, the site's unit
    vector added to ``totals[b, j]`` and 1 to ``counts[b, j]``. Products of float32 numbers are exact in float64."""
    n_pos, d = pos.shape[0], sites[0].shape[2]
    for t in range(t0, t1):
        b, p = t // n_pos, t % n_pos
        q = pos[p]
        for g in range(groups.shape[0]):
            x, y, z = sites[groups[g, 0]][b, q], sites[groups[g, 1]][b, q], sites[groups[g, 2]][b, q]
            s0 = s1 = s2 = s3 = s4 = s5 = 0.0
            for i in range(d):
                a0, a1, a2 = np.float64(x[i]), np.float64(y[i]), np.float64(z[i])
                s0 += a0 * a0; s1 += a0 * a1; s2 += a0 * a2; s3 += a1 * a1; s4 += a1 * a2; s5 += a2 * a2
            sums = (s0, s1, s2, s3, s4, s5)
            for c in range(6):
                if rows[g, c] >= 0:
                    dots[rows[g, c], b, p] = sums[c]
        for j in range(norm_of.shape[0]):
            n = np.sqrt(max(dots[norm_of[j, 1], b, p], 0.0))
            if n > eps:
                u, inv = sites[norm_of[j, 0]][b, q], 1.0 / n
                counts[b, j] += 1.0
                for i in range(d):
                    totals[b, j, i] += np.float64(u[i]) * inv
