"""NumPy references (float64) for the layer tests, and shared helpers."""

import numpy as np

SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def linear(x, w, b, dy):
    """y = x w^T + b and the gradients for dy."""
    y = x @ w.T + (b if b is not None else 0.0)
    return y, {"dx": dy @ w, "dw": dy.T @ x, "db": dy.sum(axis=0)}


def norm(x, gamma, beta, dy, eps, rms=False):
    """LayerNorm (beta given) or RMSNorm (rms=True) over the last axis, and the gradients."""
    if rms:
        rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        xhat = x * rstd
    else:
        mean = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (x - mean) * rstd
    y = xhat * gamma + (0.0 if rms else beta)
    dxhat = dy * gamma
    if rms:
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    else:
        dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    grads = {"dx": dx, "dgamma": (dy * xhat).sum(axis=0)}
    if not rms:
        grads["dbeta"] = dy.sum(axis=0)
    return y, grads


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))


def gelu_tanh_grad(x):
    t = np.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def layernorm_mlp(x, p, dy, eps, rms=False):
    """norm -> fc1 -> GeLU(tanh) -> fc2 with parameters p (gamma, beta, w1, b1, w2, b2)."""
    normed, _ = norm(x, p["gamma"], p.get("beta"), np.zeros_like(x), eps, rms)
    pre = normed @ p["w1"].T + p["b1"]
    act = gelu_tanh(pre)
    y = act @ p["w2"].T + p["b2"]
    dact = dy @ p["w2"]
    dpre = dact * gelu_tanh_grad(pre)
    dnormed = dpre @ p["w1"]
    _, norm_grads = norm(x, p["gamma"], p.get("beta"), dnormed, eps, rms)
    grads = {"dx": norm_grads["dx"], "dgamma": norm_grads["dgamma"], "dw1": dpre.T @ normed, "db1": dpre.sum(axis=0),
             "dw2": dy.T @ act, "db2": dy.sum(axis=0)}
    if not rms:
        grads["dbeta"] = norm_grads["dbeta"]
    return y, grads


def assert_close(actual, expected, rtol, atol, what):
    """|actual - expected| <= atol + rtol |expected| elementwise, naming `what` and the worst element."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    error = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else ()
    assert np.all(error <= bound), (f"{what}: worst at {worst}: got {actual[worst]}, expected {expected[worst]} "
                                    f"(error {error[worst]:.3g} > bound {bound[worst]:.3g})")
