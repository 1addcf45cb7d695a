#pragma once
// examples/common/line_chart.hpp: a small SVG line chart (curves of (x, y) points on linear
// axes with ticks and a legend), for the examples' training curves. No dependency.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace examples {

/// One curve: its legend name, colour (any SVG colour) and points (x ascending).
struct Curve {
    std::string name;
    std::string colour;
    std::vector<std::pair<double, double>> points;
    bool dashed = false;
};

/// Writes `curves` to the SVG file `path` (std::runtime_error if it cannot be written).
/// Axes span every finite point; non-finite points are skipped.
inline void write_line_chart(const std::string& path, const std::string& title,
                             const std::string& x_label, const std::string& y_label,
                             const std::vector<Curve>& curves) {
    constexpr double W = 720, H = 420, L = 70, R = 170, T = 40, B = 50;
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    for (const Curve& c : curves) {
        for (const auto& [x, y] : c.points) {
            if (!std::isfinite(x) || !std::isfinite(y)) continue;
            x0 = std::min(x0, x); x1 = std::max(x1, x);
            y0 = std::min(y0, y); y1 = std::max(y1, y);
        }
    }
    if (!(x0 <= x1)) { x0 = 0; x1 = 1; y0 = 0; y1 = 1; }
    if (x1 == x0) x1 = x0 + 1;
    if (y1 == y0) y1 = y0 + 1;
    const double pad = 0.05 * (y1 - y0);
    y0 -= pad; y1 += pad;
    const auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    const auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
    std::ofstream f(path);
    if (!f) throw std::runtime_error("cannot write " + path);
    char buf[160];
    f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
         "fill=\"white\"/>\n<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" "
         "font-size=\"15\">" << title << "</text>\n";
    for (int i = 0; i <= 5; ++i) {  // ticks and grid
        const double x = x0 + (x1 - x0) * i / 5, y = y0 + (y1 - y0) * i / 5;
        std::snprintf(buf, sizeof buf, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                      "stroke=\"#ddd\"/>\n", L, py(y), W - R, py(y));
        f << buf;
        std::snprintf(buf, sizeof buf, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.3g"
                      "</text>\n", L - 6, py(y) + 4, y);
        f << buf;
        std::snprintf(buf, sizeof buf, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.4g"
                      "</text>\n", px(x), H - B + 18, x);
        f << buf;
    }
    f << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\""
      << H - T - B << "\" fill=\"none\" stroke=\"black\"/>\n<text x=\"" << (L + W - R) / 2
      << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">" << x_label << "</text>\n"
      << "<text transform=\"translate(16 " << (T + H - B) / 2 << ") rotate(-90)\" "
         "text-anchor=\"middle\">" << y_label << "</text>\n";
    for (std::size_t k = 0; k < curves.size(); ++k) {
        const Curve& c = curves[k];
        f << "<polyline fill=\"none\" stroke=\"" << c.colour << "\" stroke-width=\"1.8\""
          << (c.dashed ? " stroke-dasharray=\"6 4\"" : "") << " points=\"";
        for (const auto& [x, y] : c.points) {
            if (!std::isfinite(x) || !std::isfinite(y)) continue;
            std::snprintf(buf, sizeof buf, "%.1f,%.1f ", px(x), py(y));
            f << buf;
        }
        const double ly = T + 14 + 18.0 * static_cast<double>(k);
        f << "\"/>\n<line x1=\"" << W - R + 12 << "\" y1=\"" << ly - 4 << "\" x2=\""
          << W - R + 36 << "\" y2=\"" << ly - 4 << "\" stroke=\"" << c.colour
          << "\" stroke-width=\"2\"" << (c.dashed ? " stroke-dasharray=\"6 4\"" : "")
          << "/>\n<text x=\"" << W - R + 42 << "\" y=\"" << ly << "\">" << c.name << "</text>\n";
    }
    f << "</svg>\n";
    if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace examples
