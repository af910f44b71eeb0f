// Parse TraceQL queries with @grafana/lezer-traceql (the grammar Grafana's Tempo editor uses).
// stdin: a JSON array of query strings. stdout: a JSON array of {query, errors: [{from, to, near}]}.
// Exit 0 when every query parses, 1 when one does not, 2 on bad input (no queries is bad input:
// a check over nothing must not pass).
import { readFileSync } from 'node:fs';
import { parser } from '@grafana/lezer-traceql';

let queries;
try {
  queries = JSON.parse(readFileSync(0, 'utf8'));
} catch (err) {
  console.error(`stdin is not JSON: ${err.message}`);
  process.exit(2);
}
if (!Array.isArray(queries) || queries.length === 0 || !queries.every((q) => typeof q === 'string')) {
  console.error('expected a non-empty JSON array of strings');
  process.exit(2);
}

let bad = 0;
const results = queries.map((query) => {
  const errors = [];
  parser.parse(query).iterate({
    enter(node) {
      // lezer marks what it could not parse with error nodes (type.isError, shown as "⚠").
      if (node.type.isError) {
        errors.push({ from: node.from, to: node.to, near: query.slice(Math.max(0, node.from - 15), node.to + 15) });
      }
    },
  });
  if (errors.length) bad += 1;
  return { query, errors };
});
console.log(JSON.stringify(results));
process.exit(bad ? 1 : 0);
