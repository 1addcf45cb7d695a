#pragma once
// titans/memory/chunk_coefficients_backward.hpp: the reverse of chunk_coefficients.hpp (math
// §9): from the adjoints of a chunk's coefficients (beta_i, c_i, G_ik of the in-chunk read;
// g_k, s_k, beta_end, c_end, p_end of the chunk end) to the adjoints of its gates theta, eta,
// alpha, by reverse sweeps of the same recurrences (O(n) for the prefix and end terms,
// O(n^2) for G), never dividing by a product.
// Plain loops over raw pointers, like the forward: shared by the CPU backend and device code.

#include "../config.hpp"

namespace titans {

/// Adjoints of a chunk prefix's gates. n tokens with gates theta, eta, alpha; adjoints in, each
/// optional (nullptr = zero): dbeta[i], dc[i] for rows i < n (the in-chunk read's beta_i, c_i;
/// beta_{n-1} = beta_end and c_{n-1} = c_end, so the end's adjoints go in there too), dG
/// (n x n row-major, lower triangular, the in-chunk read's G_ik), dg[k], ds[k] (the chunk
/// end's coefficients); dp_end (P_{n-1}) is a scalar. Adjoints out, ADDED to: dtheta, deta,
/// dalpha (n each). scratch: at least 6 n values.
template <class T>
TITANS_HOST_DEVICE void chunk_coefficients_backward(int n, const T* theta, const T* eta,
                                                    const T* alpha, const T* dbeta, const T* dc,
                                                    const T* dG, const T* dg, const T* ds,
                                                    T dp_end, T* dtheta, T* deta, T* dalpha,
                                                    T* scratch) {
    if (n <= 0) {
        return;
    }
    // The chunk end: g_k = theta_k r_k, s_k = theta_k E_k with D_k = prod_{j>k} (1 - alpha_j),
    // r_k = D_k + eta_{k+1} r_{k+1}, E_k = prod_{j>k} eta_j (r, D, E = 1 at k = n-1).
    if (dg != nullptr || ds != nullptr) {
        T *r = scratch, *D = scratch + n, *E = scratch + 2 * n;
        T *dr = scratch + 3 * n, *dD = scratch + 4 * n, *dE = scratch + 5 * n;
        r[n - 1] = D[n - 1] = E[n - 1] = T(1);
        for (int k = n - 2; k >= 0; --k) {
            D[k] = D[k + 1] * (T(1) - alpha[k + 1]);
            r[k] = D[k] + eta[k + 1] * r[k + 1];
            E[k] = E[k + 1] * eta[k + 1];
        }
        for (int k = 0; k < n; ++k) {
            const T gk = dg != nullptr ? dg[k] : T(0), sk = ds != nullptr ? ds[k] : T(0);
            dtheta[k] += gk * r[k] + sk * E[k];
            dr[k] = gk * theta[k];
            dE[k] = sk * theta[k];
            dD[k] = T(0);
        }
        for (int k = 0; k + 1 < n; ++k) {  // the reverse of the k = n-2 .. 0 sweep
            dD[k] += dr[k];
            deta[k + 1] += dr[k] * r[k + 1] + dE[k] * E[k + 1];
            dr[k + 1] += dr[k] * eta[k + 1];
            dD[k + 1] += dD[k] * (T(1) - alpha[k + 1]);
            dalpha[k + 1] -= dD[k] * D[k + 1];
            dE[k + 1] += dE[k] * eta[k + 1];
        }
    }
    // The in-chunk G, column by column: gamma_kk = pi_kk = 1, pi_ik = pi_{i-1,k} eta_i,
    // gamma_ik = (1 - alpha_i) gamma_{i-1,k} + pi_ik, G_ik = theta_k gamma_ik.
    if (dG != nullptr) {
        T *gamma = scratch, *pi = scratch + n;
        for (int k = 0; k < n; ++k) {
            gamma[k] = pi[k] = T(1);
            T dth = dG[k * n + k];
            for (int i = k + 1; i < n; ++i) {
                pi[i] = pi[i - 1] * eta[i];
                gamma[i] = (T(1) - alpha[i]) * gamma[i - 1] + pi[i];
                dth += dG[i * n + k] * gamma[i];
            }
            dtheta[k] += dth;
            T dgam = T(0), dpi = T(0);  // carried adjoints of gamma_{i,k}, pi_{i,k}
            for (int i = n - 1; i > k; --i) {
                dgam += dG[i * n + k] * theta[k];
                dpi += dgam;
                dalpha[i] -= dgam * gamma[i - 1];
                deta[i] += dpi * pi[i - 1];
                dgam *= (T(1) - alpha[i]);
                dpi *= eta[i];
            }
        }
    }
    // The prefix: beta_i = beta_{i-1} (1 - alpha_i), P_i = P_{i-1} eta_i,
    // c_i = (1 - alpha_i) c_{i-1} + P_i (beta_{-1} = P_{-1} = 1, c_{-1} = 0).
    T *bp = scratch, *pp = scratch + n, *cp = scratch + 2 * n;
    T b = T(1), p = T(1), c = T(0);
    for (int i = 0; i < n; ++i) {
        b *= (T(1) - alpha[i]);
        p *= eta[i];
        c = (T(1) - alpha[i]) * c + p;
        bp[i] = b;
        pp[i] = p;
        cp[i] = c;
    }
    T db = T(0), dp = dp_end, dcc = T(0);  // carried adjoints of beta_i, P_i, c_i
    for (int i = n - 1; i >= 0; --i) {
        db += dbeta != nullptr ? dbeta[i] : T(0);
        dcc += dc != nullptr ? dc[i] : T(0);
        const T b_prev = i > 0 ? bp[i - 1] : T(1), p_prev = i > 0 ? pp[i - 1] : T(1);
        const T c_prev = i > 0 ? cp[i - 1] : T(0);
        dalpha[i] -= dcc * c_prev + db * b_prev;
        dp += dcc;
        deta[i] += dp * p_prev;
        dcc *= (T(1) - alpha[i]);
        db *= (T(1) - alpha[i]);
        dp *= eta[i];
    }
}

}  // namespace titans
