/**
 * Texts the side panel and the notebook widgets both write: relative times, and what RSS and PSS count
 * of a shared model. One module, so that the panel and `%overmind status` never say it differently.
 */

// The widgets' bundles (src/widgets) take this from coreutils' lib/time.js alone (an alias of the
// build:widgets script), not the whole package; the panel shares JupyterLab's.
import { Time } from '@jupyterlab/coreutils';

import type { IPanelState } from './api';

/** Seconds since the epoch, as JupyterLab writes relative times ("2 minutes ago"). */
export function agoText(seconds: number): string {
  return Time.formatHuman(new Date(seconds * 1000));
}

/**
 * Why tools that add up RSS (top, jupyter-resource-usage, a notebook's memory meter) show more than
 * the cache holds: every kernel that uses a model maps the same shared pages, and RSS counts them in
 * each. PSS divides shared pages among the processes that map them. Two kernels using one 4.1 GiB model
 * showed 4.71 GB RSS each, and 2.47 GB PSS each.
 */
export const PSS_TEXT =
  'Kernels map cached models from shared memory: tools that add up RSS count a model once per kernel ' +
  'using it; PSS (proportional set size, in /proc/PID/smaps_rollup) splits shared pages among the ' +
  'kernels and adds up to what is really used.';

/** The line under the memory figures that PSS_TEXT explains on hover. */
export const PSS_LINE = 'Shared by every kernel that uses it: RSS counts a model once per kernel, PSS once in all.';

/** "3 hits of 4 lookups (75%)". */
export function hitRate(stats: IPanelState['stats']): { text: string; percent: number | null } {
  const hits = stats.hits ?? 0;
  const misses = stats.misses ?? 0;
  const percent = hits + misses > 0 ? Math.round((100 * hits) / (hits + misses)) : null;
  return { text: `${hits} / ${misses}${percent === null ? '' : ` (${percent}% hits)`}`, percent };
}
