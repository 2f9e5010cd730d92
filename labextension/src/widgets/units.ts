/**
 * The GPU units bar of `%overmind units` and `%overmind status` (overmind_jupyter/widgets/devices.py
 * `UnitsBar`): a bar per device, a segment per holder (busy solid, idle hatched, this kernel's outlined),
 * and the panel's chart of units over time, from the samples this view saw.
 *
 * It draws `view.units_state` (the `state` trait: the side panel's `units` and `texts.unit_bytes`)
 * and `local`: this kernel's pid.
 */

import type { IDevice, IPanelState, IUnitHolder } from '../api';
import { unitsChart } from '../charts';
import { Child, h, nameOf } from '../dom';
import type { IUnitSample } from '../model';
import type { IModel, IRenderProps, IWidgetModule } from './anywidget';
import { live } from './live';
import './units.css';

/** Samples of units in use kept for the chart, as the panel keeps (model.ts). */
const UNIT_SAMPLES = 150;

/** What only the kernel knows: the `local` trait (widgets/devices.py `local_facts`). */
interface ILocal {
  /** This kernel's pid: its holdings say "(this kernel)". */
  pid?: number;
}

function mine(holder: IUnitHolder, local: ILocal): boolean {
  return holder.mine === true || (holder.pid !== null && holder.pid === local.pid);
}

/** Busy, or idle for how long, and whether the ledger asked for the units back. */
function holderState(x: IUnitHolder): Child[] {
  return [
    x.busy ? h('b', {}, 'busy') : x.busy === null ? '' : `idle ${x.idle_text}`.trim(),
    x.release_requested
      ? h('span', { class: 'om-asked', 'data-testid': 'overmind-widget-asked' }, ' · asked to release')
      : null
  ];
}

function holderTitle(x: IUnitHolder, local: ILocal): string {
  const who = mine(x, local) ? `this kernel (${nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 })})` : nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 });
  const units = x.units ?? 0;
  const state = x.busy ? 'busy' : `idle ${x.idle_text}`.trim();
  const asked = x.release_requested ? ', asked to release' : '';
  const spare = x.spare ? ', given back first when a kernel needs room' : '';
  return `${x.label || 'a model'}: ${units} ${units === 1 ? 'unit' : 'units'}, ${who}, ${state}${asked}${spare}`;
}

function deviceBlock(d: IDevice, local: ILocal): HTMLElement {
  const segments: Child[] = d.holders.map(x => {
    const segment = h(
      'div',
      {
        class: `om-seg ${x.busy ? 'om-busy' : 'om-idle'}${mine(x, local) ? ' om-mine' : ''}`,
        'data-testid': 'overmind-widget-segment',
        'data-busy': x.busy ? 'true' : 'false',
        'data-model': x.label,
        title: holderTitle(x, local)
      },
      h('span', { class: 'om-seg-label' }, `${x.label || 'a model'} (${x.units ?? '?'})`)
    );
    segment.style.flex = `${x.units ?? 1} 1 0`;
    return segment;
  });
  if (d.free > 0) {
    const free = h('div', { class: 'om-seg om-free', title: `${d.free} units free` });
    free.style.flex = `${d.free} 1 0`;
    segments.push(free);
  }
  const rows = d.holders.map(x =>
    h(
      'tr',
      { 'data-testid': 'overmind-widget-holder' },
      h('td', {}, h('span', { class: `om-swatch ${x.busy ? 'om-busy' : 'om-idle'}` }), ' ', x.label || 'a model'),
      h('td', { class: 'om-num' }, String(x.units ?? '?')),
      h(
        'td',
        { title: x.detail, 'data-testid': 'overmind-widget-holder-kernel' },
        nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 }),
        mine(x, local) ? h('b', {}, ' (this kernel)') : null
      ),
      h('td', { 'data-testid': 'overmind-widget-holder-state' }, ...holderState(x))
    )
  );
  return h(
    'div',
    { class: 'om-device', 'data-testid': 'overmind-widget-device', 'data-device': d.device },
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, d.device),
      d.simulated
        ? h('span', { class: 'om-sim', 'data-testid': 'overmind-widget-simulated' }, 'simulated')
        : h('span', { class: 'om-muted' }, d.model),
      h('span', {}, `${d.used} of ${d.total} units used, ${d.free} free`),
      d.total_text ? h('span', { class: 'om-muted' }, `(${d.total_text} on the device)`) : null
    ),
    h('div', { class: 'om-bar' }, ...segments),
    rows.length
      ? h('table', { class: 'om-holders' }, h('tbody', {}, ...rows))
      : h('div', { class: 'om-muted' }, 'no holders')
  );
}

function draw(model: IModel, root: HTMLElement, samples: IUnitSample[]): void {
  // view.units_state: the panel's `units` and the text of a unit ({} before the first snapshot)
  const state: (Pick<IPanelState, 'units'> & { texts: { unit_bytes: string } }) | null = model.get('state')?.units
    ? model.get('state')
    : null;
  const local: ILocal = model.get('local') || {};
  const error: string = model.get('error');
  const units = state?.units ?? null;
  const devices = units?.devices ?? [];
  const reserve = units?.reserve_gib ? `, ${units.reserve_gib} GiB of each device reserved` : '';
  const parts: Child[] = [
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, 'GPU units'),
      h('span', { class: 'om-muted' }, `1 unit = ${state?.texts.unit_bytes || '1 GiB'}${reserve}`),
      units?.simulated &&
        h(
          'span',
          { class: 'om-sim' },
          `simulated devices${units.fake_gpus ? ` (OVERMIND_FAKE_GPUS=${units.fake_gpus})` : ''}`
        ),
      h(
        'span',
        { class: 'om-legend' },
        h('span', { class: 'om-swatch om-busy' }),
        ' busy ',
        h('span', { class: 'om-swatch om-idle' }),
        ' idle'
      )
    )
  ];
  if (error) {
    parts.push(h('div', { class: 'om-error', 'data-testid': 'overmind-widget-units-error' }, error));
  }
  if (units?.error) {
    parts.push(h('div', { class: 'om-error' }, `ledger disabled: ${units.error}`));
  }
  if (!devices.length && !error) {
    parts.push(
      h(
        'div',
        { class: 'om-muted', 'data-testid': 'overmind-widget-nodevices' },
        'no GPU known yet (a kernel reports its devices when it first uses units)'
      )
    );
  }
  parts.push(...devices.map(d => deviceBlock(d, local)));
  if (units && units.waiting > 0) {
    parts.push(
      h(
        'div',
        { class: 'om-waiters', 'data-testid': 'overmind-widget-waiters' },
        `${units.waiting} ${units.waiting === 1 ? 'request' : 'requests'} waiting for units:`,
        h(
          'ul',
          { class: 'om-list' },
          ...units.waiters.map(w =>
            h(
              'li',
              { 'data-testid': 'overmind-widget-waiter', title: w.detail },
              `${w.label || 'a model'}: ${w.units} ${w.units === 1 ? 'unit' : 'units'} on ${w.devices.join(' or ')}, `,
              `by ${w.name}, waiting ${w.waited_text}`
            )
          )
        )
      )
    );
  }
  if (state && devices.length) {
    const used: Record<string, number> = {};
    devices.forEach(d => (used[d.device] = d.used));
    samples.push({ t: Date.now() / 1000, used });
    samples.splice(0, Math.max(0, samples.length - UNIT_SAMPLES));
    parts.push(unitsChart(state, samples));
  }
  root.replaceChildren(...(parts.filter(Boolean) as Node[]));
}

const widget: IWidgetModule = {
  render({ model, el }: IRenderProps) {
    const root = h('div', { class: 'om-w om-units', 'data-testid': 'overmind-widget-units' });
    const samples: IUnitSample[] = []; // this view's, from its first draw
    el.append(root);
    return live(model, el, ['state', 'local', 'error'], () => draw(model, root, samples));
  }
};

export default widget;
