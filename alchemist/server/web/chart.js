// A small SVG line chart: a few series over shared times, gaps where a value is null, the y axis from 0 (or the
// smallest value, when negative) to the largest. Labels are HTML around the SVG, so that they do not stretch.
const NS = "http://www.w3.org/2000/svg";
export const COLORS = ["#3451b2", "#d9480f", "#2b8a3e", "#862e9c"];

export function lineChart(svg, times, lines) {
  const values = lines.flat().filter((v) => v != null);
  const lo = Math.min(0, ...values);
  const hi = Math.max(lo, ...values);
  const top = hi > lo ? hi : lo + 1; // a flat line sits at the bottom
  const [t0, t1] = [times[0], times[times.length - 1]];
  const span = Math.max(t1 - t0, 1e-9);
  svg.setAttribute("viewBox", "0 0 300 100");
  svg.setAttribute("preserveAspectRatio", "none");
  const paths = lines.map((line, i) => {
    const runs = [[]]; // a null ends a run: the line is not drawn across a gap
    line.forEach((v, j) => {
      if (v == null) { if (runs[runs.length - 1].length) runs.push([]); return; }
      const x = ((times[j] - t0) / span) * 300;
      const y = 96 - ((v - lo) / (top - lo)) * 92;
      runs[runs.length - 1].push(`${x.toFixed(1)},${y.toFixed(1)}`);
    });
    return runs.filter((r) => r.length).map((r) => {
      const p = document.createElementNS(NS, "polyline");
      p.setAttribute("points", r.length === 1 ? `${r[0]} ${r[0]}` : r.join(" "));
      p.setAttribute("stroke", COLORS[i % COLORS.length]);
      return p;
    });
  });
  svg.replaceChildren(...paths.flat());
  return { lo, hi: values.length ? hi : null };
}
