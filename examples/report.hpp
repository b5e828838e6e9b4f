#pragma once
// Output helpers shared by kvq's command-line tools: aligned text tables, CSV, JSON (stable
// field names) and an SVG scatter plot of error against effective bits with the Pareto front.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace kvq_tools {

/// One row of results: a label, string fields and numeric fields (in insertion order).
struct Row {
  std::vector<std::pair<std::string, std::string>> text;
  std::vector<std::pair<std::string, double>> num;
  const std::string& get_text(const std::string& k) const {
    for (auto& [n, v] : text)
      if (n == k) return v;
    static const std::string empty;
    return empty;
  }
  double get(const std::string& k) const {
    for (auto& [n, v] : num)
      if (n == k) return v;
    return NAN;
  }
};

inline std::string fmt_num(double v, int prec = 4) {
  if (std::isnan(v)) return "-";
  std::ostringstream os;
  const double a = std::fabs(v);
  if (v != 0 && (a < 1e-3 || a >= 1e6)) {
    os.precision(prec - 1);
    os << std::scientific << v;
  } else {
    os.precision(prec);
    os << std::fixed << v;
  }
  return os.str();
}

/// `v` with `sig` significant digits for a narrow terminal column: fixed point between 1e-3 and
/// 1e5 ("0.0748", "1.94", "472"), scientific otherwise ("3.70e-05"); "-" for NaN.
inline std::string fmt_sig(double v, int sig = 3) {
  if (std::isnan(v)) return "-";
  if (v == 0) return "0";
  char b[32];
  const double a = std::fabs(v);
  if (a >= 1e-3 && a < 1e5) {
    const int mag = static_cast<int>(std::floor(std::log10(a)));
    std::snprintf(b, sizeof b, "%.*f", std::max(0, sig - 1 - mag), v);
  } else {
    std::snprintf(b, sizeof b, "%.*e", sig - 1, v);
  }
  return b;
}

/// Prints `text` wrapped at spaces to lines of at most `width` characters (a word longer than
/// a line stays whole), continuation lines indented by two spaces.
inline void print_wrapped(const std::string& text, std::size_t width = 120, FILE* out = stdout) {
  std::string line;
  bool fresh = true;  // nothing but the indent on this line yet
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(pos, end - pos);
    if (!fresh && line.size() + 1 + word.size() > width) {
      std::fprintf(out, "%s\n", line.c_str());
      line = "  ";
      fresh = true;
    }
    if (!fresh) line += ' ';
    line += word;
    fresh = false;
    pos = end + 1;
  }
  std::fprintf(out, "%s\n", line.c_str());
}

/// Prints rows as an aligned table (text columns first, then numbers).
inline void print_table(const std::vector<Row>& rows, FILE* out = stdout) {
  if (rows.empty()) return;
  std::vector<std::string> head;
  for (auto& [k, v] : rows[0].text) head.push_back(k);
  for (auto& [k, v] : rows[0].num) head.push_back(k);
  std::vector<std::vector<std::string>> cells;
  for (auto& r : rows) {
    std::vector<std::string> c;
    for (auto& [k, v] : r.text) c.push_back(v);
    for (auto& [k, v] : r.num) c.push_back(fmt_num(v));
    cells.push_back(c);
  }
  std::vector<size_t> w(head.size());
  for (size_t i = 0; i < head.size(); ++i) {
    w[i] = head[i].size();
    for (auto& c : cells) w[i] = std::max(w[i], c[i].size());
  }
  auto line = [&](const std::vector<std::string>& c) {
    for (size_t i = 0; i < c.size(); ++i)
      std::fprintf(out, i < rows[0].text.size() ? "%-*s  " : "%*s  ", static_cast<int>(w[i]),
                   c[i].c_str());
    std::fprintf(out, "\n");
  };
  line(head);
  for (auto& c : cells) line(c);
}

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", ch);
          o += b;
        } else {
          o += ch;
        }
    }
  }
  return o;
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

/// Marks a meta value as raw JSON (a number, true/false) instead of a string.
inline std::string raw_json(const std::string& v) { return "\x01" + v; }

/// JSON: {"<meta key>": ..., "results": [ {row}, ... ]}. Meta values are strings unless made
/// with raw_json().
inline std::string to_json(const std::vector<Row>& rows,
                           const std::vector<std::pair<std::string, std::string>>& meta) {
  std::ostringstream os;
  os << "{\n";
  for (auto& [k, v] : meta) {
    os << "  \"" << json_escape(k) << "\": ";
    if (!v.empty() && v[0] == '\x01') {
      os << v.substr(1) << ",\n";
    } else {
      os << "\"" << json_escape(v) << "\",\n";
    }
  }
  os << "  \"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    os << "    {";
    bool first = true;
    for (auto& [k, v] : rows[i].text) {
      os << (first ? "" : ", ") << "\"" << json_escape(k) << "\": \"" << json_escape(v) << "\"";
      first = false;
    }
    for (auto& [k, v] : rows[i].num) {
      os << (first ? "" : ", ") << "\"" << json_escape(k) << "\": " << json_number(v);
      first = false;
    }
    os << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  os << "  ]\n}\n";
  return os.str();
}

inline std::string to_csv(const std::vector<Row>& rows) {
  std::ostringstream os;
  if (rows.empty()) return "";
  bool first = true;
  for (auto& [k, v] : rows[0].text) os << (first ? "" : ",") << k, first = false;
  for (auto& [k, v] : rows[0].num) os << (first ? "" : ",") << k, first = false;
  os << "\n";
  for (auto& r : rows) {
    first = true;
    for (auto& [k, v] : r.text) os << (first ? "" : ",") << '"' << v << '"', first = false;
    for (auto& [k, v] : r.num) os << (first ? "" : ",") << json_number(v), first = false;
    os << "\n";
  }
  return os.str();
}

/// Indices of rows on the Pareto front of (x smaller better, y smaller better).
inline std::vector<size_t> pareto_front(const std::vector<double>& x, const std::vector<double>& y) {
  std::vector<size_t> idx;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i])) continue;
    bool dominated = false;
    for (size_t j = 0; j < x.size() && !dominated; ++j) {
      if (j == i || !std::isfinite(x[j]) || !std::isfinite(y[j])) continue;
      dominated = x[j] <= x[i] && y[j] <= y[i] && (x[j] < x[i] || y[j] < y[i]);
    }
    if (!dominated) idx.push_back(i);
  }
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  return idx;
}

/// SVG scatter: x = effective bits (linear), y = error (log10), one colour per group, Pareto
/// front drawn as a line and its points labelled.
/// Text for SVG/XML content and attributes.
inline std::string xml_escape(const std::string& t) {
  std::string o;
  for (char c : t) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

/// Scatter plot of y (log scale) against x with one colour per group, the Pareto front (fewer
/// bits and lower error) dashed and labelled, every point titled (hover) with its label.
/// `subtitle` (may be empty) is a second, smaller title line, e.g. the input description.
inline std::string svg_plot(const std::vector<double>& x, const std::vector<double>& y,
                            const std::vector<std::string>& labels,
                            const std::vector<std::string>& groups, const std::string& title,
                            const std::string& subtitle, const std::string& xlabel,
                            const std::string& ylabel) {
  const double W = 1100, H = 680, L = 80, R = 290, T = 66, B = 60;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i]) || y[i] <= 0) continue;
    x0 = std::min(x0, x[i]);
    x1 = std::max(x1, x[i]);
    y0 = std::min(y0, std::log10(y[i]));
    y1 = std::max(y1, std::log10(y[i]));
  }
  if (x0 > x1) x0 = 0, x1 = 1, y0 = -1, y1 = 0;
  x0 = std::floor(x0) - 0.5;
  x1 = std::ceil(x1) + 0.5;
  y0 = std::floor(y0);
  y1 = std::ceil(y1);
  if (y1 <= y0) y1 = y0 + 1;
  auto px = [&](double v) { return L + (v - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double v) { return T + (y1 - std::log10(v)) / (y1 - y0) * (H - T - B); };
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  std::map<std::string, int> gi;
  for (auto& g : groups)
    if (!gi.count(g)) {
      const int k = static_cast<int>(gi.size());
      gi[g] = k;
    }
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
        "fill=\"white\"/>\n";
  os << "<text x=\"" << (L + W - R) / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">"
     << xml_escape(title) << "</text>\n";
  if (!subtitle.empty())
    os << "<text x=\"" << (L + W - R) / 2 << "\" y=\"44\" text-anchor=\"middle\" font-size=\"11\" "
          "fill=\"#444\">"
       << xml_escape(subtitle) << "</text>\n";
  // axes and grid
  for (int e = static_cast<int>(y0); e <= static_cast<int>(y1); ++e) {
    const double yy = py(std::pow(10.0, e));
    os << "<line x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << yy << "\" y2=\"" << yy
       << "\" stroke=\"#ddd\"/><text x=\"" << L - 8 << "\" y=\"" << yy + 4
       << "\" text-anchor=\"end\">1e" << e << "</text>\n";
  }
  for (int b = static_cast<int>(std::ceil(x0)); b <= static_cast<int>(x1); ++b) {
    const double xx = px(b);
    os << "<line x1=\"" << xx << "\" x2=\"" << xx << "\" y1=\"" << T << "\" y2=\"" << H - B
       << "\" stroke=\"#eee\"/><text x=\"" << xx << "\" y=\"" << H - B + 18
       << "\" text-anchor=\"middle\">" << b << "</text>\n";
  }
  os << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << W - L - R << "\" height=\""
     << H - T - B << "\" fill=\"none\" stroke=\"black\"/>\n";
  os << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 15 << "\" text-anchor=\"middle\">"
     << xml_escape(xlabel) << "</text>\n";
  os << "<text transform=\"translate(20," << (T + H - B) / 2
     << ") rotate(-90)\" text-anchor=\"middle\">" << xml_escape(ylabel) << "</text>\n";
  // Pareto front
  const auto front = pareto_front(x, y);
  if (front.size() > 1) {
    os << "<polyline fill=\"none\" stroke=\"black\" stroke-dasharray=\"5,3\" points=\"";
    for (size_t i : front) os << px(x[i]) << "," << py(y[i]) << " ";
    os << "\"/>\n";
  }
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(y[i]) || y[i] <= 0) continue;
    const char* col = kColors[gi[groups[i]] % 10];
    os << "<circle cx=\"" << px(x[i]) << "\" cy=\"" << py(y[i]) << "\" r=\"5\" fill=\"" << col
       << "\" fill-opacity=\"0.8\"><title>" << xml_escape(labels[i]) << ": " << x[i]
       << " bits, " << y[i] << "</title></circle>\n";
  }
  // Labels of the front's points, each placed at the first of a few offsets where its box
  // (estimated at 6 px per character) overlaps no label placed before and stays inside;
  // a label with no free spot is left out (its point keeps the hover title).
  struct Box {
    double x0, y0, x1, y1;
  };
  std::vector<Box> placed;
  for (size_t i : front) {
    const double w = 6.0 * static_cast<double>(labels[i].size()), h = 11;
    const double cx = px(x[i]), cy = py(y[i]);
    const double offsets[][2] = {{7, -6},      {7, 14},       {-7 - w, -6},  {-7 - w, 14},
                                 {7, -20},     {7, 28},       {-7 - w, -20}, {-7 - w, 28},
                                 {7, -34},     {7, 42},       {-7 - w, -34}, {-7 - w, 42},
                                 {-w / 2, -10}, {-w / 2, 20}, {7, -48},      {7, 56}};
    double bx = 0, by = 0;
    bool found = false;
    for (const auto& o : offsets) {
      const Box b{cx + o[0], cy + o[1] - h + 2, cx + o[0] + w, cy + o[1] + 2};
      bool ok = b.x0 >= L + 2 && b.x1 <= W - R - 2 && b.y0 >= T + 2 && b.y1 <= H - B - 2;
      for (const Box& p : placed)
        ok = ok && (b.x1 < p.x0 || b.x0 > p.x1 || b.y1 < p.y0 || b.y0 > p.y1);
      if (ok) {
        bx = cx + o[0];
        by = cy + o[1];
        found = true;
        break;
      }
    }
    if (!found) continue;  // no free spot: the point keeps its hover title only
    placed.push_back({bx, by - h + 2, bx + w, by + 2});
    os << "<text x=\"" << bx << "\" y=\"" << by << "\" font-size=\"10\">"
       << xml_escape(labels[i]) << "</text>\n";
  }
  // legend
  double ly = T + 10;
  for (auto& [g, k] : gi) {
    os << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\""
       << kColors[k % 10] << "\"/><text x=\"" << W - R + 30 << "\" y=\"" << ly + 4 << "\">"
       << xml_escape(g) << "</text>\n";
    ly += 18;
  }
  os << "<line x1=\"" << W - R + 12 << "\" x2=\"" << W - R + 28 << "\" y1=\"" << ly << "\" y2=\""
     << ly << "\" stroke=\"black\" stroke-dasharray=\"5,3\"/><text x=\"" << W - R + 30
     << "\" y=\"" << ly + 4 << "\">Pareto front</text>\n";
  os << "</svg>\n";
  return os.str();
}

inline void write_file(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << content;
  if (!f) throw std::runtime_error("error writing " + path);
}

}  // namespace kvq_tools
