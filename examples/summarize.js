// An agent-generated tool script: per-column statistics of a CSV file.
// Usage (inside the sandbox): node summarize.js data.csv
// Writes summary.json into the current directory (the workspace), then tries a few things
// it should not be able to do and reports what happened.
"use strict";
const fs = require("fs");
const os = require("os");
const net = require("net");

const [, , input] = process.argv;
const lines = fs.readFileSync(input, "utf8").trim().split("\n");
const header = lines[0].split(",");
const rows = lines.slice(1).map((l) => l.split(",").map(Number));
const summary = {};
header.forEach((name, i) => {
  const col = rows.map((r) => r[i]);
  const sum = col.reduce((a, b) => a + b, 0);
  summary[name] = { n: col.length, sum, mean: sum / col.length, min: Math.min(...col), max: Math.max(...col) };
});
fs.writeFileSync("summary.json", JSON.stringify(summary, null, 2));
console.log(`summarized ${rows.length} rows x ${header.length} columns`);

function attempt(name, fn) {
  try {
    fn();
    console.log(`${name}: ALLOWED`);
  } catch (err) {
    console.log(`${name}: blocked (${err.code || err.message})`);
  }
}
attempt("read ~/.ssh/id_rsa", () => fs.readFileSync(os.homedir() + "/.ssh/id_rsa"));
attempt("write /etc/passwd", () => fs.writeFileSync("/etc/passwd", "x"));
const sock = net.connect({ host: "127.0.0.1", port: 22 });
sock.setTimeout(2000, () => { console.log("connect 127.0.0.1:22: blocked (timeout)"); sock.destroy(); });
sock.on("connect", () => { console.log("connect 127.0.0.1:22: ALLOWED"); sock.destroy(); });
sock.on("error", (err) => console.log(`connect 127.0.0.1:22: blocked (${err.code})`));
