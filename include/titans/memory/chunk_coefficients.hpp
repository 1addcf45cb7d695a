#pragma once
// titans/memory/chunk_coefficients.hpp: the scalar coefficients of the closed-form chunk
// update (math §4), computed with running products and reverse recurrences, never by dividing
// products (eta or 1 - alpha may be 0).
//
// For a chunk prefix of n tokens (0-based i, k here; the paper uses 1-based) with gates theta_i,
// eta_i, alpha_i:
//   P_i    = prod_{j<=i} eta_j                      beta_i = prod_{j<=i} (1 - alpha_j)
//   c_i    = (1 - alpha_i) c_{i-1} + P_i            (c_{-1} = 0)
//   G_ik   = theta_k gamma_ik, gamma_kk = 1, gamma_ik = (1 - alpha_i) gamma_{i-1,k} + pi_ik,
//            pi_ik = prod_{j=k+1..i} eta_j
//   end:   g_k = G_{n-1,k} = theta_k r_k, r_{n-1} = 1,
//            r_k = prod_{j=k+1..n-1}(1 - alpha_j) + eta_{k+1} r_{k+1}
//          s_k = theta_k prod_{j=k+1..n-1} eta_j    (momentum: S^e = P_{n-1} S^s - sum_k s_k u_k)
// Then W_i = beta_i W^s + c_i S^s - sum_{k<=i} G_ik u_k and S_i = P_i S^s - sum_k ... .
// Plain loops over raw pointers: shared by the CPU backend and (later) device code.

#include "../config.hpp"

namespace titans {

/// Coefficients that take a chunk prefix of n tokens from (W^s, S^s) to (W_{n-1}, S_{n-1}).
/// Outputs: g[k] (weights) and s[k] (momentum), k < n; *beta_end, *c_end, *p_end.
template <class T>
TITANS_HOST_DEVICE void chunk_end_coefficients(int n, const T* theta, const T* eta,
                                               const T* alpha, T* g, T* s, T* beta_end,
                                               T* c_end, T* p_end) {
    T beta = T(1), p = T(1), c = T(0);
    for (int i = 0; i < n; ++i) {
        beta *= (T(1) - alpha[i]);
        p *= eta[i];
        c = (T(1) - alpha[i]) * c + p;
    }
    *beta_end = beta;
    *c_end = c;
    *p_end = p;
    // Reverse recurrences: suffix products of (1 - alpha) and eta after k.
    T r = T(1), decay_after = T(1), eta_after = T(1);
    for (int k = n - 1; k >= 0; --k) {
        if (k < n - 1) {
            decay_after *= (T(1) - alpha[k + 1]);
            r = decay_after + eta[k + 1] * r;
            eta_after *= eta[k + 1];
        }
        g[k] = theta[k] * r;
        s[k] = theta[k] * eta_after;
    }
}

/// beta[i - row0] and c[i - row0] of chunk_row_coefficients, rows i = row0..n-1.
template <class T>
TITANS_HOST_DEVICE void chunk_row_prefix(int n, int row0, const T* eta, const T* alpha, T* beta,
                                         T* c) {
    T b = T(1), p = T(1), cc = T(0);
    for (int i = 0; i < n; ++i) {
        b *= (T(1) - alpha[i]);
        p *= eta[i];
        cc = (T(1) - alpha[i]) * cc + p;
        if (i >= row0) {
            beta[i - row0] = b;
            c[i - row0] = cc;
        }
    }
}

/// Column k of chunk_row_coefficients' G (rows i = row0..n-1; 0 where i < k): its own
/// recurrence gamma_ik, independent of the other columns (device code runs them in parallel).
template <class T>
TITANS_HOST_DEVICE void chunk_row_column(int n, int row0, int k, const T* theta, const T* eta,
                                         const T* alpha, T* G) {
    for (int i = row0; i < k && i < n; ++i) {
        G[(i - row0) * n + k] = T(0);
    }
    T gamma = T(1), pi = T(1);
    for (int i = k; i < n; ++i) {
        if (i > k) {
            pi *= eta[i];
            gamma = (T(1) - alpha[i]) * gamma + pi;
        }
        if (i >= row0) {
            G[(i - row0) * n + k] = theta[k] * gamma;
        }
    }
}

/// Per-row coefficients of the in-chunk (dual form) retrieval, math §5: for rows
/// i = row0..n-1 of a chunk prefix of n tokens, beta[i - row0], c[i - row0] and the
/// lower-triangular G (row-major, (n - row0) x n, entries with k > i set to 0).
template <class T>
TITANS_HOST_DEVICE void chunk_row_coefficients(int n, int row0, const T* theta, const T* eta,
                                               const T* alpha, T* beta, T* c, T* G) {
    chunk_row_prefix(n, row0, eta, alpha, beta, c);
    for (int k = 0; k < n; ++k) {
        chunk_row_column(n, row0, k, theta, eta, alpha, G);
    }
}

}  // namespace titans
